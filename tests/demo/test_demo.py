"""The demo's shortened paths: the job draw, admission through the real reconcile flow on the
emulator (non-tty rendering), the live view, and the runtime part on the real cluster (its
allocation started at its CI job's dispatch, measured against Slurm's grant)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest
from rich.console import Console

from slurmgate.admission.labels import JobLabel
from slurmgate.ci.priority import job_label
from slurmgate.flows.demo import LINK_POOL, run_admission, run_runtime
from slurmgate.testbed.board import (
    AdmissionTracker,
    PoolState,
    TickView,
    parse_board_blocked,
    render_compact,
    render_live,
)
from slurmgate.testbed.demo import (
    OWN_STARTUP_BOUND_S,
    STARTED_AT_ENV,
    STARTUP_BOUND_S,
    AdmissionLink,
    AdmissionResult,
    DemoError,
    DemoJob,
    Printer,
    RuntimeResult,
    command_started_at,
    draw_jobs,
    endpoint_totals,
    invariant_line,
    link_problems,
    processes_with_env,
    summary_lines,
)
from slurmgate.testbed.emulator import fleet_from_job_mix
from slurmgate.testbed.emulator.testing import running_emulator

MIX = Path(__file__).resolve().parents[2] / "slurmgate" / "data" / "inferencex-job-mix.csv"


def test_the_draw_is_deterministic_and_loads_every_pool() -> None:
    jobs = draw_jobs(load=1.75, never_fits=2, seed=7)
    assert jobs == draw_jobs(load=1.75, never_fits=2, seed=7)
    assert jobs != draw_jobs(load=1.75, never_fits=2, seed=8)
    pools = fleet_from_job_mix(MIX)
    fitting: Counter[str] = Counter()
    wide: Counter[str] = Counter()
    for job in jobs:
        assert job.labels[:3] == ["self-hosted", f"cluster:{job.pool}", f"nodes:{job.nodes}"]
        assert job.labels[4] == "ci-attempt-1"
        assert JobLabel.parse(job.labels[3]).score == Decimal(job.score)
        assert 3.0 <= job.duration_s <= 6.0
        if job.nodes <= pools[job.pool]:
            fitting[job.pool] += job.nodes
        else:
            wide[job.pool] += 1
    for pool, capacity in pools.items():
        assert fitting[pool] >= 1.75 * capacity, pool  # every pool has waiting work
        assert wide[pool] <= 2
    # only the GB200/GB300 pools have rows wider than the pool in the mix
    assert set(wide) == {"gb200-nv", "gb300-nv"}
    assert 30 <= len(jobs) <= 70


def _job(pool: str, nodes: int, score: str, token: str, duration: float = 1.5) -> DemoJob:
    labels = [
        "self-hosted",
        f"cluster:{pool}",
        f"nodes:{nodes}",
        job_label(Decimal(score), token),
        "ci-attempt-1",
    ]
    return DemoJob(token, pool, nodes, score, labels, duration)


async def test_admission_backfills_blocks_and_releases_consistently(
    prefect_harness: None, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = [
        _job("small", 3, "5.000", "top"),  # admitted first
        _job("small", 3, "4.000", "second"),  # waits: 1 runner left
        _job("small", 1, "3.000", "little"),  # backfills past "second"
        _job("wide", 3, "9.000", "toowide"),  # a pool of 2 can never hold it
    ]
    with running_emulator({"small": 4, "wide": 2}, token="t0k", tick_s=0.05) as emu:
        result = await run_admission(
            emu, jobs, Printer(live=False), mode="direct", max_ticks=15, min_tick_s=0.5
        )
        dump = emu.admin.dump()
        stats = emu.admin.stats()
        apps = emu.admin.app_stats()
    assert result.problems == []
    # the flows authenticated as the demo's GitHub App: one installation token, nothing refused
    assert (apps["apps"], apps["tokens_issued"], apps["tokens_refused"]) == (1, 1, 0)
    by_name = {j["name"]: j for j in dump["jobs"]}
    ran = {n for n, j in by_name.items() if j["conclusion"] == "success"}
    assert ran == {"top", "second", "little"}
    assert by_name["toowide"]["conclusion"] == "cancelled"  # the demo cancels never-fits
    assert by_name["toowide"]["runner_id"] is None
    # the summary agrees with the emulator and with the flows' own counters
    assert result.admitted == result.admitted_by_flow == result.completed == 3
    assert result.released_by_flow == 3
    assert list(result.never_fits.values()) == ["larger-than-any-compatible-pool"]
    assert result.leases_left == 0
    assert not any(
        lb["name"].startswith(("ci-lease-", "ci-job-", "nodes:"))
        for r in dump["runners"]
        for lb in r["labels"]
    )
    calls = sum(n for k, n in stats["requests"].items() if "/_emulator" not in k)
    assert result.api_calls == result.api_calls_by_flow == calls
    assert result.peak_utilization == {"small": 1.0, "wide": 0.0}
    assert result.capacity == {"small": 4, "wide": 2}
    [backfill] = result.backfills
    little, second = by_name["little"]["id"], by_name["second"]["id"]
    assert (backfill["job_id"], backfill["past_job_id"], backfill["tick"]) == (little, second, 1)
    # non-tty: one compact block per tick (and "tick N running" lines while a slow one runs),
    # the backfill and the never-fit among the events
    out = capsys.readouterr().out
    assert len(re.findall(r"^tick \d+ t=", out, flags=re.M)) == result.ticks
    running = re.findall(r"^tick (\d+) running: \d+ jobs? dispatched so far, t=\d+s$", out, re.M)
    assert len(running) == len(re.findall(r"^tick \d+ running", out, flags=re.M))
    assert f"BACKFILL job {little} (1n, score 3.000) runs while job {second}" in out
    assert "can never run in wide: larger-than-any-compatible-pool" in out


def test_live_view_shows_capacity_leases_and_blocked_reasons() -> None:
    dump = {
        "runners": [
            {
                "id": i,
                "status": "online",
                "labels": [{"name": "cluster:p"}]
                + ([{"name": "ci-lease-j7-a1-t100"}] if i < 3 else []),
            }
            for i in range(4)
        ],
        "jobs": [
            {"id": 7, "status": "in_progress", "labels": ["cluster:p", "nodes:3"]},
            {"id": 8, "status": "queued", "labels": ["cluster:p", "nodes:2", "ci-job-4.000-x"]},
        ],
    }
    rows = [{"pool": "cluster:p", "blocked": "job 8 (2n): no-free-capacity"}]
    assert parse_board_blocked(rows) == {"p": [(8, "no-free-capacity")]}
    tracker = AdmissionTracker()
    view = tracker.observe(1, dump, rows, elapsed_s=3.0, api_calls=12)
    [pool] = view.pools
    assert (pool.online, pool.leased, pool.leases, pool.running) == (4, 3, 1, 1)
    assert tracker.peak == {"p": 0.75}
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    console.print(render_live(view, view.events))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "3/4" in text and "no-free-capacity" in text and "admitted job 7" in text


def _link(dispatched: float, asked: float, granted: float, **fields: object) -> AdmissionLink:
    base: dict[str, object] = {
        "pool": "slurm-demo",
        "partition": "debug",
        "job_id": 50001,
        "anchor": "slurm-demo-01",
        "admitted_by_flow": 1,
        "released_by_flow": 1,
        "slurm_capacity": "4/4 nodes usable in partition debug",
        "leases_left": 0,
        "dispatched_at": 1000.0 + dispatched,
        "flow_started_at": 1000.0 + dispatched + 0.001,
        "salloc_asked_at": 1000.0 + asked,
        "granted_at": 1000.0 + granted,
        "completed": True,
    }
    return AdmissionLink(**{**base, **fields})  # type: ignore[arg-type]


def test_the_invariant_line_and_its_problems() -> None:
    """Dispatch -> grant within the bound is the job's own startup; a late grant, a wait in
    Slurm's queue, a grant before the dispatch, an admission without Slurm's capacity or a lease
    left behind each fail the demo with the reason."""
    good = _link(0.0, 0.4, 0.406)
    assert link_problems(good) == []
    rt = RuntimeResult(run_id="r", job_id="1", hosts=["node1", "node2", "node3"], link=good)
    lines = summary_lines(None, rt, 1.0)
    assert (
        "invariant: job 50001 dispatched to slurm-demo-01; its Slurm allocation started 0.406 s "
        "later (salloc asked -> granted 0.006 s; the rest is the job's own startup: dispatch -> "
        "allocation flow called 0.001 s, flow -> salloc asked 0.399 s)"
    ) in lines
    assert lines[-1] == "demo: OK"
    # seconds of the job's own startup (a loaded machine) are not a wait in Slurm's queue
    assert link_problems(_link(0.0, 2.5, 2.51)) == []
    late = link_problems(_link(0.0, 40.0, 40.01))
    assert late == [
        "Slurm granted job 50001's allocation 40.010 s after its dispatch (bound 30 s): the "
        "allocation did not start at the dispatch"
    ]
    queued = link_problems(_link(0.0, 0.4, 10.4))
    assert len(queued) == 1
    assert "waited 10.000 s in Slurm's queue for nodes the controller believed free" in queued[0]
    early = link_problems(_link(1.0, 0.0, 0.01))
    assert early == ["Slurm granted job 50001's allocation 0.990 s before its dispatch"]
    unread = link_problems(_link(0.0, 0.4, 0.41, slurm_capacity="", leases_left=1))
    assert "admitted without Slurm's capacity for pool slurm-demo" in unread[0]
    assert unread[1] == "the runtime's CI job: 1 lease released by the reconcile runs, 1 left"
    missing = AdmissionLink(pool="slurm-demo", partition="debug", job_id=7)
    assert invariant_line(missing).startswith("invariant: not measured (job 7:")
    assert any("dispatch or grant not recorded" in p for p in link_problems(missing))


def test_endpoint_totals_read_the_metric_rows() -> None:
    rows = [
        {"metric": "slurmgate_endpoint_requests_total", "labels": "endpoint=a", "value": "10"},
        {
            "metric": "slurmgate_endpoint_responses_total",
            "labels": "endpoint=a,status=200",
            "value": "7",
        },
        {
            "metric": "slurmgate_endpoint_responses_total",
            "labels": "endpoint=a,status=429",
            "value": "3",
        },
    ]
    assert endpoint_totals(rows) == {"requests": 10, "served": 7, "throttled": 3}


@pytest.mark.slurm
def test_runtime_part_serves_throttles_and_cleans_up(
    slurm_cluster: dict[str, str],
    prefect_harness: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    result = run_runtime(tmp_path)
    assert result.problems == []
    # the flow's log stays off the console: one line says what runs, and for how long it ran
    said = capsys.readouterr().err
    assert "runtime: allocation demo on Slurm (3 nodes)…" in said, said
    assert re.search(r" done in \d+ s$", said, re.M), said  # (the flow logs INFO in tests)
    assert result.served > 0 and result.throttled_429 > 0
    assert set(result.loadgen) == {"normal-chat", "normal-pipe", "overload-pipe"}
    assert result.loadgen["normal-chat"]["throttled"] == 0
    assert result.loadgen["overload-pipe"]["throttled"] == result.throttled_429
    assert sum(r["ok"] for r in result.loadgen.values()) == result.served
    assert result.cleanup_complete and not result.slurm_job_left
    assert processes_with_env("SLURMGATE_RUN_ID", result.run_id) == []
    # the allocation belongs to a CI job the reconcile flow admitted with Slurm's capacity on an
    # emulator; its anchor's allocation started at the dispatch, and the lease is gone after
    link = result.link
    assert link is not None and link.job_id is not None
    assert link.admitted_by_flow == 1
    assert link.slurm_capacity == "4/4 nodes usable in partition debug"
    assert re.fullmatch(rf"{LINK_POOL}-0[1-4]", link.anchor), link
    assert link.dispatched_at is not None and link.granted_at is not None
    assert link.salloc_asked_at is not None and link.flow_started_at is not None
    assert link.dispatched_at <= link.flow_started_at <= link.salloc_asked_at < link.granted_at
    waited = link.dispatch_to_grant_s
    assert waited is not None and 0 < waited < OWN_STARTUP_BOUND_S, link
    assert link.queue_wait_s is not None and link.queue_wait_s < STARTUP_BOUND_S
    assert link.completed and link.released_by_flow == 1 and link.leases_left == 0
    line = invariant_line(link)
    assert line.startswith(f"invariant: job {link.job_id} dispatched to {link.anchor}; "), line
    print(line)


async def test_a_failing_tick_makes_the_demo_fail_with_the_reason(prefect_harness: None) -> None:
    jobs = [_job("small", 1, "3.000", "one")]
    with running_emulator({"small": 2}, token="t0k", tick_s=0.05) as emu:
        emu.admin.fault("status", status=401, count=None, path="/repos/*/actions/runners*")
        result = await run_admission(
            emu, jobs, Printer(live=False), mode="direct", max_ticks=2, min_tick_s=0.1
        )
    assert result.admitted == 0
    assert any("reconcile tick 1 failed" in p for p in result.problems), result.problems
    lines = summary_lines(result, None, 1.0)
    assert lines[-1] == "demo: FAILED"
    assert any(line.startswith("!! reconcile tick 1 failed") for line in lines)


async def test_admission_through_the_served_reconcile_deployment(
    prefect_harness: None, tmp_path: Path
) -> None:
    """The demo's default path: every tick is a run of the served deployment, whose summary
    (a persisted flow result) agrees with what the fleet showed."""
    from prefect.settings import PREFECT_API_URL

    from slurmgate.flows.demo import served_reconcile

    api = PREFECT_API_URL.value()
    jobs = [_job("small", 2, "5.000", "first"), _job("small", 2, "4.000", "next", 1.0)]
    with (
        running_emulator({"small": 3}, token="t0k", tick_s=0.05) as emu,
        served_reconcile(tmp_path, api) as deployment,
    ):
        result = await run_admission(
            emu,
            jobs,
            Printer(live=False),
            mode="deployment",
            deployment=deployment,
            max_ticks=10,
            min_tick_s=0.2,
        )
        dump = emu.admin.dump()
    assert result.problems == []
    assert result.admitted == result.admitted_by_flow == result.completed == 2
    assert result.ticks >= 3  # admit, release + admit, release
    assert [j["conclusion"] for j in dump["jobs"]] == ["success", "success"]
    assert result.peak_utilization == {"small": 2 / 3}


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"load": 0}, "--load"),
        ({"never_fits": -1}, "--never-fits"),
        ({"duration_s": 0}, "--duration"),
    ],
)
def test_bad_draw_arguments_name_the_flag(args: dict[str, float], field: str) -> None:
    with pytest.raises(DemoError, match=f"^{field} "):
        draw_jobs(**args)  # type: ignore[arg-type]


def test_counts_read_in_the_right_number_and_total_time_is_the_whole_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one = AdmissionResult(
        jobs=1,
        ticks=1,
        admitted=1,
        admitted_by_flow=1,
        released_by_flow=0,
        completed=0,
        never_fits={},
        backfills=[
            {
                "job_id": 2,
                "nodes": 1,
                "pool": "p",
                "past_job_id": 1,
                "past_nodes": 2,
                "past_score": "5.000",
            }
        ],
        peak_utilization={"p": 0.5},
        capacity={"p": 2},
        api_calls=3,
        api_calls_by_flow=3,
        leases_left=1,
        seconds=1.0,
        mode="direct",
    )
    [line] = [s for s in summary_lines(one, None, 1.0) if s.startswith("admission")]
    assert "1 job queued" in line and "1 backfill," in line and "1 tick in" in line
    assert line.endswith("1 lease left")
    two = AdmissionResult(**{**one.__dict__, "jobs": 2, "ticks": 2, "leases_left": 2})
    [line] = [s for s in summary_lines(two, None, 1.0) if s.startswith("admission")]
    assert "2 jobs queued" in line and "2 ticks in" in line and line.endswith("2 leases left")
    view = TickView(1, 1.0, [PoolState("p", 2, 2, 2, leases=1)], [], 1, 0, 0, 3, 0, 0)
    assert "(1 lease, 0 running" in render_compact(view)
    # scripts/demo.sh stamps its own start: the total covers setup and the Slurm start
    monkeypatch.setenv(STARTED_AT_ENV, str(time.time() - 300))
    assert 299 < time.time() - command_started_at() < 310
    monkeypatch.delenv(STARTED_AT_ENV)
    assert 0 <= time.time() - command_started_at() < 24 * 3600  # this process's start


@pytest.mark.prefect_server
def test_the_demo_command_says_what_it_starts_and_ends_with_its_summary(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`slurmgate demo` as `make demo` runs it (a Prefect server of its own, the served reconcile
    deployment, then the allocation flow in this process), on a small draw: each slow part is one
    line with its time, the summary is the last thing printed (the flows' log handler once
    outlived the server and printed "Error logging to API" after `demo: OK`), and nothing on the
    way is an ERROR or a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SLURM_JOB"))}
    env.pop("DO_NOT_TRACK", None)
    # The flows' log lines wait in Prefect's queue to the end, as the last ones do when the server
    # stops within a batch interval of them: the demo must send them before it stops the server.
    env["PREFECT_LOGGING_TO_API_BATCH_INTERVAL"] = "600"
    argv = [sys.executable, "-m", "slurmgate.cli", "demo", "--live", "no"]
    options = ["--load", "0.05", "--never-fits", "0", "--duration", "0.5"]
    done = subprocess.run(
        [*argv, *options, "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=400,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert done.stdout.rstrip().endswith("demo: OK"), done.stdout[-2000:]
    noisy = [line for line in out.splitlines() if re.search(r"\bERROR\b|Traceback", line)]
    assert noisy == [] and "Error logging to API" not in out, out[-4000:]
    assert done.stderr.startswith("prefect: flow runs go to a Prefect server the demo starts")
    for start in (
        r"prefect: starting a temporary Prefect server",
        r"prefect: serving the reconcile deployment",
        r"runtime: allocation demo on Slurm \(3 nodes\)",
    ):
        assert re.search(rf"^{start}.*… (ready|done) in \d+ s$", done.stderr, re.M), done.stderr
    assert "each tick runs the served `reconcile` deployment" in done.stdout
    [line] = [s for s in done.stdout.splitlines() if s.startswith("admission (deployment): ")]
    queued = re.search(r"(\d+) jobs? queued, (\d+) admitted", line)
    assert queued and queued[1] == queued[2] and "0 leases left" in line, line
    assert "cleanup verified: yes" in done.stdout
    assert re.search(r"^total time: \d+ s \(the whole command\)$", done.stdout, re.M)
    # the runtime's CI job went through the served deployment too, and its allocation started
    # at its dispatch
    admitted = rf"runtime: its CI job \(nodes:3, cluster:{LINK_POOL}\) admitted by the reconcile"
    assert re.search(rf"^{admitted}.*… dispatched in \d+ s$", done.stderr, re.M), done.stderr
    assert re.search(r"^  admission: job \d+ .* admitted by the reconcile flow", done.stdout, re.M)
    invariant = re.search(
        rf"^invariant: job \d+ dispatched to {LINK_POOL}-0\d; its Slurm allocation started "
        r"(\d+\.\d+) s later \(salloc asked -> granted (\d+\.\d+) s; ",
        done.stdout,
        re.M,
    )
    assert invariant, done.stdout[-3000:]
    assert float(invariant[2]) < STARTUP_BOUND_S
    assert float(invariant[2]) <= float(invariant[1]) < OWN_STARTUP_BOUND_S
