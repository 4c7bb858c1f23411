"""Cleanup on the real cluster when Slurm fails it, and a deployment whose second lane cannot spawn.

The first test freezes slurmctld (SIGSTOP) as the client's last act, so the run's own cleanup
cannot cancel anything: a run whose client succeeded must end `cleanup-failed`, say so in its
record and exit 1. It runs first on purpose: the test after it proves the cluster still works.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmgate.runtime.ledger.records import load_records
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm
from slurmgate.testbed import cluster

from .conftest import assert_no_orphans, job_gone

pytestmark = pytest.mark.slurm

# Longer than the frozen stretch of the test (about a minute); if pytest itself dies while
# slurmctld is stopped, the cluster wakes up after this on its own.
WATCHDOG_S = 180

FREEZING_CLIENT = r"""
import json, os, signal, sys, urllib.request
url = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["serve"]
body = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 2}).encode()
req = urllib.request.Request(url + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    assert r.status == 200 and json.loads(r.read())["choices"]
print("completion ok", flush=True)
os.kill(int(sys.argv[1]), signal.SIGSTOP)  # the last act: Slurm's controller stops answering
print("slurmctld frozen", flush=True)
"""


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # owned allocations only
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def _deployment(name: str, replicas: int, command: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "command": command,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "replicas": replicas,
        "lanes_per_node": replicas,
        "nodes_per_replica": 1,
        "gpus_per_node": replicas,
        "base_port": 18600,
        "endpoint_port": 17600,
        "startup_timeout_s": 60,
        "distributed_timeout_s": 30,
        "lead_boot_standoff_s": 0,
        "rank_launch_stagger_s": 0,
        **extra,
    }


def _spec_data(name: str, client: list[str], deployment: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "name": name,
        "gpus_per_node": 8,
        "time_limit": "00:05:00",
        # The endpoint and the client get node 0; the lanes run on another node.
        "client": {"command": client, "dedicated_node": True},
        "deployments": [deployment],
    }


def _process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


@pytest.fixture
def slurmctld_pid() -> Iterator[int]:
    """The local slurmctld's pid (from its pidfile); it is always resumed afterwards."""
    config = slurm.run(["scontrol", "show", "config"]).stdout
    found = re.search(r"^SlurmctldPidFile\s*=\s*(\S+)", config, re.M)
    try:
        pid = int(Path(found.group(1)).read_text().split()[0]) if found else 0
        comm = Path(f"/proc/{pid}/comm").read_text().strip() if pid else ""
    except (OSError, ValueError):
        pid, comm = 0, ""
    if comm != "slurmctld":
        pytest.skip("slurmctld does not run on this machine: the test must be able to freeze it")
    if os.environ.get("SLURMGATE_LOCAL_SLURM") != "1":
        pytest.skip("freezing slurmctld needs the bundled cluster, which the test restarts after")
    watchdog = subprocess.Popen(
        ["sh", "-c", f"sleep {WATCHDOG_S}; kill -CONT {pid}"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)  # first of all: other tests and engineers share it
        os.killpg(watchdog.pid, signal.SIGKILL)
        watchdog.wait()
        # A step that ended while slurmctld was frozen keeps its slurmstepd retrying the step
        # completion for a minute or more; Slurm then drains the node ("Kill task failed").
        # That is Slurm's own recovery, not the run's, so give later tests a fresh cluster.
        cluster.down()
        cluster.up(mode=os.environ.get("SLURM_LOCAL_MODE", "netns"))
        states = slurm.sinfo_states()
        assert states and all(s == "idle" for s in states.values()), states


def test_a_failed_cleanup_turns_a_successful_run_into_a_failure(
    runs_root: Path, tmp_path: Path, slurmctld_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI: exit 1, and the record says cleanup-failed although the client passed."""
    # Cleanup's collection of the nodes' outputs cannot start a step either: each node's
    # attempt runs out its limit, kept short here so the test's budget is Slurm's calls'.
    monkeypatch.setenv("SLURMGATE_OUTPUTS_NODE_TIMEOUT_S", "5")
    spec = _spec_data(
        "frozen-ctld",
        ["python", "-c", FREEZING_CLIENT, str(slurmctld_pid)],
        _deployment("serve", 1, ["python", "-m", "slurmgate.testbed.stub_server"]),
    )
    spec_path = tmp_path / "frozen-ctld.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    err_path = tmp_path / "controller.err"
    try:
        with err_path.open("w") as err:
            # With slurmctld stopped every Slurm call of the cleanup waits out its timeout.
            proc = subprocess.run(
                [sys.executable, "-m", "slurmgate.runtime.run", "run", str(spec_path),
                 "--runs-dir", str(runs_root)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, timeout=150,
            )  # fmt: skip
        ctld_state = _process_state(slurmctld_pid)
    finally:
        os.kill(slurmctld_pid, signal.SIGCONT)  # first: the cluster is shared
        records = load_records(runs_root)
        job_id = records[0].job_id if records else None
    try:
        stderr = err_path.read_text()
        (record,) = records
        assert ctld_state == "T", "slurmctld was not stopped during cleanup"
        assert proc.returncode == 1, stderr[-3000:]
        run_dir = runs_root / record.run_id
        client_log = next(run_dir.glob("[0-9][0-9]-client.log")).read_text()
        assert "completion ok" in client_log and "slurmctld frozen" in client_log, client_log
        assert "client succeeded" in stderr
        # The client succeeded; the run did not, because cleanup could not release the allocation.
        failed = re.search(r"run \S+ failed: cleanup left survivors: (.*)", stderr)
        assert failed and f"allocation {job_id}" in failed.group(1), stderr[-3000:]
        assert "timed out" in failed.group(1)
        assert record.status == "cleanup-failed" and record.cleanup_complete is False
        assert record.error is None  # no phase failed
        assert record.owned_allocation is True and job_id
    finally:
        if job_id:
            slurm.scancel(job_id)
    # With slurmctld back (and the cancel it had queued, or ours), nothing of the run is left.
    assert job_gone(job_id, within=30.0)
    assert_no_orphans(record.run_id, within=30)


def test_partial_startup_through_srun_cleans_the_first_lane(
    runs_root: Path, tmp_path: Path
) -> None:
    # The server's launcher is removed once the first lane has started (an install replaced
    # between two lane starts), so the second lane, 1.5 s later, cannot be spawned at all.
    launcher = tmp_path / "serve-model"
    launcher.write_text(
        '#!/bin/sh\nrm -f "$0"\nexec python -m slurmgate.testbed.stub_server "$@"\n'
    )
    launcher.chmod(0o755)
    spec = AllocationSpec.from_data(
        _spec_data(
            "partial",
            ["python", "-c", "print('never runs')"],
            _deployment("part", 2, [str(launcher)], rank_launch_stagger_s=1.5),
        ),
        source="test",
    )
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as info:
        run.run()
    assert time.monotonic() - t0 < 30
    assert info.value.phase == "readiness", str(info.value)
    assert run.layout is not None
    (node,) = run.layout.nodelist(run.plan.deployments[0])
    assert node != run.layout.client_host
    message = str(info.value)
    assert "required step serve-part exited with status 71" in message, message
    assert re.search(
        rf"\[node-worker {node}\] lane part-replica-00001-rank-00000 failed to start "
        rf"\({re.escape(str(launcher))}\): No such file or directory",
        message,
    ), message
    serve_log = next(run.run_dir.glob("*-serve-part.log")).read_text()
    first = re.search(r"started lane part-replica-00000-rank-00000 pid (\d+)", serve_log)
    assert first, serve_log  # the first lane did start (no orphan check below finds it)
    assert "started lane part-replica-00001" not in serve_log
    assert not list(run.run_dir.glob("[0-9][0-9]-client.log"))  # the client never ran
    assert run.status == "failed" and run.cleaned
    record = json.loads(run.record_path.read_text())
    assert record["status"] == "failed" and record["cleanup_complete"] is True
    assert job_gone(run.job_id, within=30.0)
    assert_no_orphans(run.run_id)
