"""Runtime history (quantiles, merge, JSON) and the simulate command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmgate.admission.estimates import (
    Estimate,
    Estimator,
    HistoryError,
    RuntimeHistory,
    expected_end,
    high_quantile,
    job_key,
)
from slurmgate.cli.app import run as cli
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.simulator.engine import POLICY_KNOBS, simulate
from slurmgate.simulator.traces import read_trace

SWF = Path(__file__).with_name("tiny.swf")


def test_expected_end_falls_back_from_prediction_to_limit_to_extension() -> None:
    est = Estimate(100, 400)
    assert expected_end(1000, est, 1050, 60) == 1100
    assert expected_end(1000, est, 1100, 60) == 1400  # past the prediction: the limit
    assert expected_end(1000, est, 1400, 60) == 1460  # past the limit: slides with now
    assert expected_end(1000, est, 5000, 60) == 5060
    assert Estimate(900, 400).predicted_s == 400  # a prediction never exceeds the limit
    with pytest.raises(ValueError, match="positive"):
        Estimate(0, 10)


def test_learned_estimate_is_a_high_quantile_once_enough_runs_are_known() -> None:
    history = RuntimeHistory(keep=5)
    key = job_key("  Bench (dsr1,  8k1k) ", 4)
    assert key == job_key("bench (dsr1, 8k1k)", 4) != job_key("bench (dsr1, 8k1k)", 8)
    learned = Estimator("learned", 0.9, 3, history)
    assert learned.estimate(key, 3600) == Estimate(3600, 3600)
    for i, runtime in enumerate([300, 100, 200, 5000, 400, 250]):
        history.record(key, i, runtime, 10_000 + i)
    assert sorted(history.runtimes(key)) == [100, 200, 250, 400, 5000]  # newest 5 kept
    assert high_quantile([100, 200, 250, 400, 5000], 0.9) == 5000
    assert high_quantile([100, 200, 250, 400, 5000], 0.5) == 250
    assert learned.estimate(key, 3600) == Estimate(3600, 3600)  # capped by the timeout
    assert Estimator("learned", 0.5, 3, history).estimate(key, 3600) == Estimate(250, 3600)
    assert Estimator("timeout", 0.5, 3, history).estimate(key, 3600) == Estimate(3600, 3600)


def test_history_merge_is_a_union_that_order_cannot_change() -> None:
    a, b = RuntimeHistory(keep=3), RuntimeHistory(keep=3)
    for i in range(4):
        a.record("k", i, 10 + i, 100 + i)
    for i in range(2, 7):
        b.record("k", i, 10 + i, 100 + i)
    b.record("other", 9, 7, 50)
    merged = a.merge(b)
    assert merged.to_json() == b.merge(a).to_json() == merged.merge(a).to_json()
    assert sorted(merged.runtimes("k")) == [14, 15, 16]
    assert merged.runtimes("other") == [7]


def test_history_json_round_trip_and_errors_name_the_field() -> None:
    h = RuntimeHistory()
    h.record("bench|n4", 11, 321.5, 1_700_000_000)
    assert RuntimeHistory.from_json(h.dumps()).to_json() == h.to_json()
    assert RuntimeHistory.from_json({}).records == {}
    with pytest.raises(HistoryError, match="'format'"):
        RuntimeHistory.from_json({"format": 9, "jobs": {}})
    with pytest.raises(HistoryError, match=r"'jobs\.bench\|n4'"):
        RuntimeHistory.from_json({"format": 1, "jobs": {"bench|n4": [[1, 2]]}})
    with pytest.raises(HistoryError, match="not JSON"):
        RuntimeHistory.from_json("{oops")


def test_simulate_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    classic = ["--policy", "easy", "--estimates", "timeout", "--reserve-after", "0"]
    code = cli(["simulate", str(SWF), "--pools", "16", *classic, "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["jobs"] == 3 and out["policy"] == "easy" and out["pools"] == {"cluster:p0": 16}
    # the anchor scenario: A (9) starts at 100 s, B (8, 1000 s) only after A
    assert out["max_wait_h"] == pytest.approx(598 / 3600)
    greedy = cli(["simulate", str(SWF), "--pools", "16", "--policy", "greedy", "--json"])
    assert greedy == 0
    assert json.loads(capsys.readouterr().out)["max_wait_h"] == pytest.approx(1001 / 3600)


def test_simulate_without_policy_flags_replays_the_controller_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for knob in POLICY_KNOBS:
        monkeypatch.delenv(f"SLURMGATE_{knob.upper()}", raising=False)
    controller = AdmissionSettings()
    assert cli(["simulate", str(SWF), "--pools", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # every knob the replay depends on is the controller's own default
    assert out["settings"] == controller.model_dump(mode="json", include=set(POLICY_KNOBS))
    assert set(POLICY_KNOBS) >= {
        name for name in AdmissionSettings.model_fields if name.startswith(("reserve", "backfill"))
    }
    # the same replay as the library with the controller's settings: same waits, job for job
    trace = read_trace(SWF)
    settings = controller.model_copy(
        update={"PRIORITY_SCHEDULER_ENABLED": True, "NODE_SLOT_SCHEDULER_ENABLED": True}
    )
    result = simulate(
        trace, {"cluster:p0": 16}, settings.policy, estimates=settings.estimates, settings=settings
    )
    assert out["max_wait_h"] == pytest.approx(result.metrics()["max_wait_h"])


def test_simulate_flags_set_every_reservation_knob(capsys: pytest.CaptureFixture[str]) -> None:
    flags = {
        "--reserve-after": ("1.5", "reserve_after_s", 5400.0),
        "--estimates": ("learned", "estimates", "learned"),
        "--wide-fraction": ("0.5", "wide_fraction", 0.5),
    }
    args = [a for flag, (value, _, _) in flags.items() for a in (flag, value)]
    assert cli(["simulate", str(SWF), "--pools", "16", *args, "--json"]) == 0
    knobs = json.loads(capsys.readouterr().out)["settings"]
    assert {field: knobs[field] for _, field, _ in flags.values()} == {
        field: value for _, field, value in flags.values()
    }


def test_simulate_wide_fraction_none_turns_the_wide_job_rules_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli(["simulate", str(SWF), "--pools", "16", "--wide-fraction", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["wide_fraction"] is None


def test_simulate_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "gantt.png"
    code = cli(["simulate", str(SWF), "--pools", "16", "--json", "--plot", str(target)])
    assert code == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out)["plot"] == str(target)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pools", "0"], "--pools entry '0'"),
        (["--pools", "16", "--policy", "sjf"], "--policy 'sjf'"),
        (["--pools", "16", "--estimates", "oracle"], "--estimates 'oracle'"),
        (["--pools", "16", "--wide-frac", "2"], "--wide-frac"),
        (["--pools", "16", "--reserve-after", "-1"], "--reserve-after -1.0"),
        (["--pools", "16", "--wide-fraction", "1.5"], "--wide-fraction '1.5'"),
        (["--pools", "16", "--wide-fraction", "most"], "--wide-fraction 'most'"),
        ([], "--pools is required"),
    ],
)
def test_bad_flags_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["simulate", str(SWF), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["simulate", str(tmp_path / "nope.swf"), "--pools", "4"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_history_learns_from_completed_jobs_of_a_snapshot() -> None:
    from dataclasses import replace
    from datetime import UTC, datetime, timedelta

    from slurmgate.admission.model import Job, JobStatus

    t0 = datetime(2026, 11, 29, tzinfo=UTC)
    base = Job(
        1,
        1,
        1,
        "bench (dsr1, 8k1k)",
        ("cluster:x", "nodes:4"),
        JobStatus.COMPLETED,
        t0,
        conclusion="success",
        started_at=t0,
        completed_at=t0 + timedelta(minutes=30),
    )
    jobs = [
        base,
        replace(base, id=2, conclusion="failure", completed_at=t0 + timedelta(minutes=5)),
        replace(base, id=3, conclusion="cancelled"),
        replace(base, id=4, status=JobStatus.IN_PROGRESS, completed_at=None),
        replace(base, id=5, labels=("nodes:x",)),
    ]
    history = RuntimeHistory()
    assert history.learn(jobs) == 2
    assert sorted(history.runtimes(job_key("bench (dsr1, 8k1k)", 4))) == [300, 1800]


def test_benchmark_charts_write_pngs(tmp_path: Path) -> None:
    from slurmgate.simulator.metrics import Run
    from slurmgate.simulator.plots import busiest_day, wait_cdf, wide_waits

    runs = [Run(1, 0, 90_000, 50, 8, "p", (1, 2)), Run(2, 0, 10, 50, 1, "p", (3,))]
    assert busiest_day(runs, "p") == 86_400  # the day where the 8-node job started after waiting
    cdf = wait_cdf({"a": [0.0, 1.0, 2.0], "b": [0.5]}, tmp_path / "cdf.png", "t")
    wide = wide_waits({"a": [(1.0, 3.0)]}, tmp_path / "wide.png", "t")
    for path in (cdf, wide):
        assert path.read_bytes()[:4] == b"\x89PNG"
