"""The allocation flow through real Prefect on the real cluster: artifacts, and SIGTERM cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime.ledger.records import load_records
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm

from .conftest import assert_no_orphans, example_data, processes_with
from .test_hooks_slurm import _prefect_log_lines

pytestmark = pytest.mark.slurm

CLI = ["-m", "slurmgate.cli", "allocation"]


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def test_flow_runs_the_example_and_publishes_artifacts(
    prefect_harness: None, runs_root: Path
) -> None:
    from prefect.artifacts import Artifact

    from slurmgate.flows.allocation import allocation

    since = datetime.now(UTC) - timedelta(seconds=1)
    summary = allocation(spec=AllocationSpec.from_data(example_data()), runs_dir=str(runs_root))
    assert len(summary["hosts"]) == 3
    layout = Artifact.get("allocation-layout")
    assert layout is not None and "pipe" in str(layout.data) and "chat" in str(layout.data)
    stats = Artifact.get("allocation-endpoint-stats")
    assert stats is not None and "chat" in str(stats.data) and "pipe" in str(stats.data)
    record = Artifact.get("allocation-record")
    assert record is not None and summary["run_id"] in str(record.data)
    assert str(summary["job_id"]) in str(record.data)
    progress = Artifact.get("allocation-readiness")
    assert progress is not None and float(progress.data) == 100.0  # type: ignore[arg-type]
    # The client's output is in the flow run's log on the server, not only in its step log.
    assert _prefect_log_lines(since, "client| client ok: 8 completions")
    assert_no_orphans(summary["run_id"])


def test_sigterm_to_the_flow_process_mid_readiness_cleans_up(tmp_path: Path) -> None:
    data = example_data()
    data["deployments"][0]["env"] = {"SLURMGATE_STUB_HANG": "1"}
    spec = tmp_path / "hang.yaml"
    spec.write_text(yaml.safe_dump(data))
    runs_root = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env.pop("PREFECT_API_URL", None)
    log = (tmp_path / "flow.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, *CLI, "run", str(spec), "--runs-dir", str(runs_root)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    # the command starts its own temporary Prefect server first: a minute and more under load
    deadline = time.monotonic() + 240
    record = None
    while time.monotonic() < deadline:
        records = load_records(runs_root)
        if records and records[0].phase == "readiness":
            record = records[0]
            break
        time.sleep(0.2)
    assert record is not None, "the flow never reached readiness"
    time.sleep(1.0)
    assert processes_with(record.run_id)
    # The command and its temporary Prefect server: what must be gone after the signal.
    assert len(processes_with(env["PREFECT_HOME"])) >= 2
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    elapsed = time.monotonic() - t0
    out = (tmp_path / "flow.log").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, out
    # The temporary Prefect server (a child with this PREFECT_HOME) is not orphaned.
    assert_no_orphans(env["PREFECT_HOME"])
    assert "run failed in phase readiness: TerminationSignal" in out
    assert elapsed < 20, out
    final = load_records(runs_root)[0]
    assert final.cleanup_complete is True, out
    assert final.status == "failed"
    info = slurm.show_job(final.job_id)
    assert info is None or not info.active
    assert_no_orphans(record.run_id)


SERVE = (
    "from slurmgate.flows.allocation import allocation; "
    "allocation.serve(name='allocation-test', print_starting_message=False)"
)


def test_cancel_through_the_prefect_api_mid_readiness_cleans_up(
    prefect_harness: None, tmp_path: Path
) -> None:
    """A served deployment, a run started and cancelled through the API, as CI would."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling

    data = example_data()
    data["deployments"][0]["env"] = {"SLURMGATE_STUB_HANG": "1"}
    runs_root = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(Path(__file__).resolve().parents[2]),
        start_new_session=True,
    )
    try:
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.read_deployment_by_name("allocation/allocation-test")
                    break
                except Exception:
                    assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
                    time.sleep(0.5)
            flow_run = run_deployment(
                "allocation/allocation-test",
                parameters={"spec": data, "runs_dir": str(runs_root)},
                timeout=0,
            )
            deadline = time.monotonic() + 90
            record = None
            while time.monotonic() < deadline and record is None:
                for rec in load_records(runs_root):
                    if rec.phase == "readiness":
                        record = rec
                time.sleep(0.2)
            assert record is not None, (tmp_path / "serve.log").read_text()
            time.sleep(1.0)
            assert processes_with(record.run_id)
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
            deadline = time.monotonic() + 60
            while True:
                state = client.read_flow_run(flow_run.id).state
                if state is not None and state.is_final():
                    break
                assert time.monotonic() < deadline, f"run stuck in {state}"
                time.sleep(0.3)
            assert state.is_cancelled(), state
        final = load_records(runs_root)[0]
        assert final.cleanup_complete is True
        served = (tmp_path / "serve.log").read_text()
        assert "cleanup complete" in served
        assert "error was encountered while running hook" not in served, served
        info = slurm.show_job(final.job_id)
        assert info is None or not info.active
        assert_no_orphans(record.run_id)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
