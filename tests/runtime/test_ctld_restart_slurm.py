"""An allocation run across two restarts of slurmctld: one while its lanes boot, one in cleanup.

Operators restart Slurm's controller for upgrades and configuration changes while jobs run.
Slurm keeps jobs and steps across such a restart (nodes and `srun` keep running), so a run
caught in one must carry on: readiness waits the outage out, and cleanup retries its cancel
until the controller answers again. Nothing of the run may be left on any node afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime.ledger.records import RunStatus, load_records
from slurmgate.slurm import commands as slurm

from .conftest import assert_no_orphans

# serial: it restarts slurmctld, and a step created while a busy machine re-registers the nodes
# can be refused ("Memory required by task is not available"); it runs first in the Slurm pass.
pytestmark = [pytest.mark.slurm, pytest.mark.serial]

REPO = Path(__file__).resolve().parents[2]
RESTART = REPO / "scripts" / "slurm-local" / "restart-ctld.sh"
DOWN_S = 4  # each outage: long enough that several Slurm calls of the run meet a dead controller

# The client's last act marks the file; the test then restarts slurmctld, so the run's cleanup
# (which starts a second later) meets a controller that is stopping, down, and coming back.
CLIENT = r"""
import json, os, sys, time, urllib.request
url = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["boot"]
body = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 2}).encode()
req = urllib.request.Request(url + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    assert r.status == 200 and json.loads(r.read())["choices"]
print("completion ok", flush=True)
open(sys.argv[1], "w").close()
time.sleep(1.0)
"""


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("SLURMGATE_LOCAL_SLURM") != "1":
        pytest.skip("restarting slurmctld needs the bundled cluster (scripts/slurm-local)")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def _restart_ctld() -> None:
    subprocess.run(
        ["bash", str(RESTART), str(DOWN_S)],
        check=True, timeout=120, stdin=subprocess.DEVNULL, capture_output=True,
    )  # fmt: skip


def _phase(runs_root: Path) -> str:
    records = load_records(runs_root)
    return records[0].phase if records else "none"


def test_a_run_survives_slurmctld_restarts_in_readiness_and_in_cleanup(
    runs_root: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "client-done"
    spec = {
        "schema_version": 1,
        "name": "ctld-restart",
        "gpus_per_node": 8,
        "time_limit": "00:05:00",
        "client": {"command": ["python", "-c", CLIENT, str(marker)], "dedicated_node": True},
        "deployments": [
            {
                "name": "boot",
                # /health stays 503 for 10 s: the first restart falls inside readiness.
                "command": ["python", "-m", "slurmgate.testbed.stub_server", "--startup-delay",
                            "10"],
                "tensor_parallel": 1, "pipeline_parallel": 1, "replicas": 1,
                "nodes_per_replica": 1, "gpus_per_node": 1,
                "base_port": 18700, "endpoint_port": 17700,
                "startup_timeout_s": 60, "distributed_timeout_s": 30,
                "lead_boot_standoff_s": 0, "rank_launch_stagger_s": 0,
            }
        ],
    }  # fmt: skip
    spec_path = tmp_path / "ctld-restart.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    err_path = tmp_path / "controller.err"
    seen: dict[str, str] = {}
    failures: list[BaseException] = []

    def operator() -> None:
        try:
            deadline = time.monotonic() + 60
            while _phase(runs_root) != "readiness":
                assert time.monotonic() < deadline, f"never reached readiness: {_phase(runs_root)}"
                time.sleep(0.1)
            _restart_ctld()
            seen["after first restart"] = _phase(runs_root)
            deadline = time.monotonic() + 90
            while not marker.exists():
                assert time.monotonic() < deadline, "the client never finished"
                time.sleep(0.05)
            _restart_ctld()
            seen["after second restart"] = _phase(runs_root)
        except BaseException as exc:  # reported to the test thread
            failures.append(exc)

    worker = threading.Thread(target=operator, daemon=True)
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurmgate.runtime.run", "run", str(spec_path),
             "--runs-dir", str(runs_root)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
        worker.start()
        try:
            rc = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
            worker.join(timeout=150)
    stderr = err_path.read_text()
    assert not failures, f"{failures[0]!r}\n{stderr[-3000:]}"
    (record,) = load_records(runs_root)
    # The first restart happened while the lanes booted, the second as the client ended.
    assert seen["after first restart"] == "readiness", seen
    assert rc == 0, stderr[-4000:]
    assert record.status == RunStatus.SUCCEEDED and record.cleanup_complete is True, record
    client_log = next((runs_root / record.run_id).glob("[0-9][0-9]-client.log"))
    assert "completion ok" in client_log.read_text()
    assert record.job_id and record.owned_allocation
    info = slurm.show_job(record.job_id)
    assert info is None or not info.active, info
    assert_no_orphans(record.run_id, within=30)
    # The controller and its nodes are healthy for the tests after this one.
    deadline = time.monotonic() + 30
    while True:
        states = slurm.sinfo_states()
        if states and all(s == "idle" for s in states.values()):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
