"""SWF and job-mix readers, and the metrics on a tiny trace computed by hand."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from slurmgate.simulator.metrics import Run, percentile, summarize
from slurmgate.simulator.traces import (
    JOB_MIX,
    MIX_POOLS,
    TraceError,
    read_job_mix,
    read_swf,
    read_trace,
)

HEADER = "; Version: 2.2\n; MaxNodes: 8\n"
# id submit wait run procs cpu mem req_procs req_time req_mem status user group exe q p prev think
ROWS = [
    "1 100 0 50 4 -1 -1 4 60 -1 1 7 7 3 -1 -1 -1 -1",
    "2 110 0 0 2 -1 -1 2 60 -1 1 7 7 3 -1 -1 -1 -1",  # runtime 0: dropped
    "3 120 0 30 -1 -1 -1 0 60 -1 1 7 7 3 -1 -1 -1 -1",  # size 0 everywhere: dropped
    "4 130 0 90 -1 -1 -1 3 60 -1 1 8 8 3 -1 -1 -1 -1",  # allocated missing: requested 3
    "5 140 0 20 64 -1 -1 64 -1 -1 1 8 8 3 -1 -1 -1 -1",  # no requested time
]


def write(tmp_path: Path, rows: list[str], gz: bool = False) -> Path:
    text = HEADER + "\n".join(rows) + "\n"
    if gz:
        path = tmp_path / "t.swf.gz"
        with gzip.open(path, "wt") as handle:
            handle.write(text)
        return path
    path = tmp_path / "t.swf"
    path.write_text(text)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_swf_drops_empty_jobs_clamps_limits_and_shifts_time(tmp_path: Path, gz: bool) -> None:
    trace = read_swf(write(tmp_path, ROWS, gz))
    assert trace.dropped == 2
    assert [j.id for j in trace.jobs] == [1, 4, 5]
    one, four, five = trace.jobs
    assert (one.submit_s, one.runtime_s, one.nodes, one.limit_s) == (0, 50, 4, 60)
    assert (four.nodes, four.limit_s) == (3, 90)  # overran its 60 s request: clamped to 90
    assert five.limit_s == 20  # no request: its runtime
    assert one.key != four.key  # different user


def test_swf_size_and_arrival_scaling(tmp_path: Path) -> None:
    trace = read_swf(write(tmp_path, ROWS), size_scale=32, arrival_scale=0.5)
    assert [j.nodes for j in trace.jobs] == [1, 1, 2]  # ceil(4/32), ceil(3/32), 64/32
    assert [j.submit_s for j in trace.jobs] == [0, 15, 20]


def test_bad_swf_line_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, [ROWS[0], "7 oops"])
    with pytest.raises(TraceError, match=r"t\.swf:4: not an SWF record"):
        read_swf(path)
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "missing.swf")
    with pytest.raises(TraceError, match="arrival-scale"):
        read_swf(path, arrival_scale=0)


def test_job_mix_model_is_deterministic_and_uses_stated_durations() -> None:
    trace = read_job_mix(JOB_MIX)
    assert trace == read_job_mix(JOB_MIX)
    assert trace.pools == MIX_POOLS
    assert {j.pool for j in trace.jobs} <= set(MIX_POOLS)
    assert all(j.nodes <= MIX_POOLS[j.pool or ""] for j in trace.jobs)
    agentic = [j for j in trace.jobs if j.limit_s == 780 * 60]
    fixed = [j for j in trace.jobs if j.limit_s == 480 * 60]
    assert agentic and fixed and len(agentic) + len(fixed) == len(trace.jobs)
    assert {j.runtime_s for j in agentic} == {3600.0}
    assert all(600 * 0.85 <= j.runtime_s <= 480 * 60 for j in fixed)
    nightly = [j for j in trace.jobs if j.submit_s == 2 * 3600]
    assert len(nightly) > 50, "the first night's sweep is queued at once"
    assert all(j.score is not None and j.score > 0 for j in trace.jobs)


def test_percentile_is_linear_interpolation() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 95) == 10
    assert percentile([0, 10], 95) == 9.5


def test_metrics_of_a_tiny_trace_by_hand() -> None:
    # 10-node pool; wide = more than 2.5 nodes
    runs = [
        Run(1, 0, 0, 100, 4, "p", (1, 2, 3, 4)),  # wait 0, bsld 1
        Run(2, 0, 100, 5, 2, "p", (1, 2)),  # wait 100, run 5 (< tau 10): bsld (105)/10 = 10.5
        Run(3, 50, 250, 200, 10, "p", tuple(range(1, 11))),  # wait 200, bsld 400/200 = 2
    ]
    m = summarize(runs, capacity=10, wide_above=2.5)
    assert m["jobs"] == 3
    work = 4 * 100 + 2 * 5 + 10 * 200  # 2410 node-s
    assert m["makespan_d"] == pytest.approx(450 / 86400)
    assert m["utilization"] == pytest.approx(work / (10 * 450))
    assert m["makespan_lower_bound_d"] == pytest.approx(max(work / 10, 50 + 200) / 86400)
    assert m["mean_wait_h"] == pytest.approx(300 / 3 / 3600)
    assert m["median_wait_h"] == pytest.approx(100 / 3600)
    assert m["max_wait_h"] == pytest.approx(200 / 3600)
    assert m["mean_bsld"] == pytest.approx((1 + 10.5 + 2) / 3)
    assert (m["wide_jobs"], m["wide_max_wait_h"]) == (2, pytest.approx(200 / 3600))
    assert m["wide_mean_wait_h"] == pytest.approx(100 / 3600)
    assert m["small_mean_wait_h"] == pytest.approx(100 / 3600)
