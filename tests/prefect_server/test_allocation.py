"""The allocation deployment on the real Slurm cluster, started and cancelled through the API."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from slurmgate.runtime.ledger.records import RunRecord, load_records
from slurmgate.slurm import commands as slurm

from .conftest import FINAL, REPO, PrefectServer

pytestmark = [pytest.mark.slurm, pytest.mark.prefect_server]

# The /proc scan and the example spec live once, in the runtime tests' helpers.
_spec = importlib.util.spec_from_file_location(
    "slurmgate_runtime_test_helpers", REPO / "tests" / "runtime" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
runtime_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runtime_helpers)

ARTIFACTS = {
    "allocation-layout",
    "allocation-readiness",
    "allocation-record",
    "allocation-endpoint-stats",
}


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str]) -> None:
    """Skip with the reason when the bundled cluster is not up."""


def wait_for_phase(runs_root: Path, phase: str, server: PrefectServer, run_id: str) -> RunRecord:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for record in load_records(runs_root):
            if record.phase == phase:
                return record
        assert server.state(run_id) not in FINAL, server.logs(run_id)
        time.sleep(0.2)
    raise AssertionError(f"the run never reached {phase}:\n{server.logs(run_id)}")


def test_allocation_through_the_api_completes_with_its_artifacts(
    served: PrefectServer, tmp_path: Path
) -> None:
    runs_root = tmp_path / "runs"
    spec = runtime_helpers.example_data()
    # The example's client, then a short streaming chat load whose report the flow publishes.
    chat_load = (
        'python -c "$1" && exec python -m slurmgate.cli loadgen "$SLURMGATE_ENDPOINT_CHAT" '
        "--chat --requests 6 --concurrency 2 --output-tokens 8"
    )
    spec["client"]["command"] = ["sh", "-c", chat_load, "client", spec["client"]["command"][2]]
    run = served.create_run("allocation/allocation", {"spec": spec, "runs_dir": str(runs_root)})
    done = served.wait_state(run["id"], FINAL, timeout=150)
    assert done["state"]["type"] == "COMPLETED", served.logs(run["id"])

    artifacts = served.artifacts(served.run_family(run["id"]))
    keys = {a["key"] for a in artifacts}
    assert keys >= ARTIFACTS | {"load-chat", "load-chat-e2e"}, sorted(keys)
    by_key = {a["key"]: a for a in artifacts}
    assert by_key["load-chat"]["type"] == "table" and "TTFT" in str(by_key["load-chat"]["data"])
    assert str(by_key["load-chat-e2e"]["data"]).startswith("data:image/png;base64,")
    assert "chat" in str(by_key["allocation-layout"]["data"])
    assert float(by_key["allocation-readiness"]["data"]) == 100.0
    (record,) = load_records(runs_root)
    assert record.status == "succeeded" and record.cleanup_complete is True
    assert record.run_id in str(by_key["allocation-record"]["data"])
    runtime_helpers.assert_no_orphans(record.run_id)
    info = slurm.show_job(str(record.job_id))
    assert info is None or not info.active


def test_cancel_through_the_api_mid_readiness_cleans_up(
    served: PrefectServer, tmp_path: Path
) -> None:
    data = runtime_helpers.example_data()
    chat = data["deployments"][0]
    chat["env"]["SLURMGATE_STUB_STARTUP_DELAY"] = "300"  # the lanes never become ready in time
    chat["startup_timeout_s"] = 600
    runs_root = tmp_path / "runs"
    run = served.create_run("allocation/allocation", {"spec": data, "runs_dir": str(runs_root)})
    record = wait_for_phase(runs_root, "readiness", served, run["id"])
    time.sleep(1.0)
    job_id = str(record.job_id)
    assert runtime_helpers.processes_with(record.run_id), "the lanes should be up"
    assert slurm.list_steps(job_id), "the run's Slurm steps should be running"

    cancel = served.api.post(
        f"/flow_runs/{run['id']}/set_state",
        json={"state": {"type": "CANCELLING", "message": "cancelled by the test"}, "force": True},
    )
    assert cancel.status_code in (200, 201), cancel.text
    done = served.wait_state(run["id"], {"CANCELLED", "FAILED", "CRASHED", "COMPLETED"}, 60)
    assert done["state"]["type"] == "CANCELLED", done["state"]

    final = load_records(runs_root)[0]
    assert final.cleanup_complete is True, final
    runtime_helpers.assert_no_orphans(record.run_id)
    assert slurm.list_steps(job_id) == []
    info = slurm.show_job(job_id)
    assert info is None or not info.active
    assert "cleanup complete" in served.logs(run["id"]) + (served.home / "serve.log").read_text(
        errors="replace"
    )
