"""Site hooks in the allocation flow on the real cluster, through real Prefect and prefect-shell:
a failing prolog, a hanging epilog, and a flow process SIGKILLed while its prolog runs."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmgate.runtime.ledger.reaper import reap_stale_runs
from slurmgate.runtime.ledger.records import load_records
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import assert_no_orphans, example_data, job_gone, processes_with
from .test_hooks import kill_marked

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _marker() -> str:
    return f"hook-marker-{secrets.token_hex(4)}"


def _prefect_log_lines(
    since: datetime, needle: str, within: float = 15.0, level: int = 0
) -> list[str]:
    """Messages of the Prefect API's logs since `since`, at `level` or above, that contain
    `needle` (logs reach the server in batches: wait for them a little)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp

    deadline = time.monotonic() + within
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(
                log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=since)), limit=200
            )
            found = [log.message for log in logs if needle in log.message and log.level >= level]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.5)


def test_a_failing_prolog_launches_nothing_and_the_error_has_its_output(
    prefect_harness: None, runs_root: Path
) -> None:
    from slurmgate.flows.allocation import allocation

    marker = _marker()
    data = example_data()
    data["hooks"] = {
        "prolog": {
            "commands": [f"echo checking licences {marker}", "echo 'no licence left' >&2; exit 4"]
        },
        "epilog": {"commands": ["echo epilog after a run that $SLURMGATE_RUN_OUTCOME"]},
    }
    since = datetime.now(UTC) - timedelta(seconds=1)
    with pytest.raises(RunFailed) as info:
        allocation(spec=AllocationSpec.from_data(data), runs_dir=str(runs_root))
    message = str(info.value)
    assert "prolog: the prolog exited 4" in message and "nothing was launched" in message
    assert f"checking licences {marker}" in message and "no licence left" in message
    (record,) = load_records(runs_root)
    assert record.steps == []  # no srun of any kind was started
    assert record.status == "failed" and record.cleanup_complete is True
    assert record.hooks["prolog"].returncode == 4 and record.hooks["epilog"].returncode == 0
    epilog_log = (runs_root / record.run_id / "hook-epilog.log").read_text()
    assert "epilog after a run that failed" in epilog_log
    assert job_gone(record.job_id)
    # prefect-shell streamed the hook's lines into the flow run's logs on the Prefect server.
    assert _prefect_log_lines(since, f"prolog| checking licences {marker}")


def test_a_hanging_epilog_is_stopped_at_its_timeout_and_the_result_says_so(
    prefect_harness: None, runs_root: Path, tmp_path: Path
) -> None:
    from slurmgate.flows.allocation import allocation

    marker = _marker()
    seen = tmp_path / "prolog-saw"
    data = example_data()
    data["hooks"] = {
        "prolog": {"commands": [f'echo "$SLURM_JOB_ID $SLURMGATE_HOSTS" > {seen}']},
        "epilog": {
            "commands": ["echo epilog starts", "sleep 300 & sleep 301"],
            "timeout_s": 2,
            "env": {"HOOK_MARKER": marker},
        },
    }
    since = datetime.now(UTC) - timedelta(seconds=1)
    summary = allocation(spec=AllocationSpec.from_data(data), runs_dir=str(runs_root))
    assert summary["hooks"]["prolog"].startswith("succeeded"), summary
    assert summary["hooks"]["epilog"].startswith("timed out after 2.0 s"), summary
    assert summary["hooks_failed"] == ["epilog"], summary
    assert seen.read_text().split() == [str(summary["job_id"]), ",".join(summary["hosts"])]
    assert_no_orphans(marker, within=3.0)
    (record,) = load_records(runs_root)
    assert record.status == "succeeded"  # the epilog's failure is reported, not the run's
    assert record.hooks["epilog"].timed_out is True
    assert_no_orphans(record.run_id)
    from prefect.artifacts import Artifact

    artifact = Artifact.get("allocation-record")
    assert artifact is not None and "| epilog | timed out after 2.0 s" in str(artifact.data)
    # A site sees it: a warning in the flow run's log on the Prefect server.
    assert _prefect_log_lines(since, "hook epilog timed out after 2.0 s", level=logging.WARNING)


def _allocation_run(data: dict[str, Any], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """`slurmgate allocation run` of `data` (written as a spec file, runs under tmp_path/runs)
    against the harness's Prefect API: its argv and environment."""
    from prefect.settings import PREFECT_API_URL

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    argv = [sys.executable, "-m", "slurmgate.cli", "allocation", "run", str(spec)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return [*argv, "--runs-dir", str(tmp_path / "runs")], env


def test_sigkill_of_the_flow_process_during_the_prolog_leaves_no_hook_process(
    prefect_harness: None, tmp_path: Path
) -> None:
    marker = _marker()
    data = example_data()
    data["hooks"] = {
        "prolog": {"commands": ["echo prolog sleeps", "sleep 300"], "env": {"HOOK_MARKER": marker}}
    }
    argv, env = _allocation_run(data, tmp_path)
    runs_root = tmp_path / "runs"
    log = tmp_path / "flow.log"
    with log.open("w") as out:
        flow = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not any("sleep 300" in p for p in processes_with(marker)):
            assert flow.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        (record,) = load_records(runs_root)
        assert record.phase == "prolog"
        flow.send_signal(signal.SIGKILL)
        flow.wait(timeout=10)
        # The hook's guard saw its parent go and stopped the hook's whole tree.
        assert_no_orphans(marker, within=5.0)
        assert_no_orphans(str(runs_root / record.run_id), within=5.0)
        # The allocation the dead controller held is the reaper's, from the run's record.
        tally = reap_stale_runs(load_records(runs_root), wait_out_backoff=False)
        assert tally.reaped == 1, tally
        assert job_gone(record.job_id)
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait()
        kill_marked(marker)
        reap_stale_runs(load_records(runs_root), wait_out_backoff=False)


def test_sigterm_during_the_prolog_stops_it_cleans_up_and_runs_the_epilog(
    prefect_harness: None, tmp_path: Path
) -> None:
    marker = _marker()
    data = example_data()
    data["hooks"] = {
        "prolog": {"commands": ["sleep 300"], "env": {"HOOK_MARKER": marker}},
        "epilog": {"commands": ["echo epilog after a run that $SLURMGATE_RUN_OUTCOME"]},
    }
    argv, env = _allocation_run(data, tmp_path)
    runs_root = tmp_path / "runs"
    log = tmp_path / "flow.log"
    with log.open("w") as out:
        flow = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not any("sleep 300" in p for p in processes_with(marker)):
            assert flow.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        flow.send_signal(signal.SIGTERM)
        flow.wait(timeout=60)
        text = log.read_text()
        assert flow.returncode == 128 + signal.SIGTERM, text
        assert "run failed in phase prolog: TerminationSignal" in text
        assert_no_orphans(marker, within=3.0)
        (record,) = load_records(runs_root)
        assert record.cleanup_complete is True and record.status == "failed", text
        assert job_gone(record.job_id)
        epilog_log = (runs_root / record.run_id / "hook-epilog.log").read_text()
        assert "epilog after a run that failed" in epilog_log
        assert "epilog| epilog after a run that failed" in text  # streamed by prefect-shell
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait()
        kill_marked(marker)
        reap_stale_runs(load_records(runs_root), wait_out_backoff=False)


def test_the_command_line_warns_of_a_failed_epilog_on_a_run_that_succeeded(
    prefect_harness: None, tmp_path: Path
) -> None:
    # A failed epilog does not fail the run: the command's own output is where a person sees it.
    data = example_data()
    data["hooks"] = {
        "prolog": {"commands": ["true"]},
        "epilog": {"commands": ["echo collecting logs", "exit 3"]},
    }
    argv, env = _allocation_run(data, tmp_path)
    ran = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "hook prolog succeeded in" in ran.stdout
    warning = [line for line in ran.stderr.splitlines() if line.startswith("warning: hook")]
    assert warning and warning[0].startswith("warning: hook epilog exited 3 after"), ran.stderr
    assert "(hook-epilog.log)" in warning[0]
    assert " succeeded on " in ran.stdout.splitlines()[-1]
