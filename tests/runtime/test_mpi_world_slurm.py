"""A TensorRT-LLM worker over two nodes as one MPI world, on the bundled cluster.

The worker's step is `srun --mpi=pmix` with a task per GPU (Debian's Open MPI under Slurm's pmix
plugin; mpi4py in the ranks). `slurmgate.testbed.mpi_launch` stands in for
`trtllm-llmapi-launch`: every rank joins the world and reports itself, rank 0 serves the stub.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm
from slurmgate.testbed.demo import processes_with_env

from .conftest import hosts_of
from .listeners import HOLD_FOR_LISTENER_WATCH, ListenerWatch
from .test_pd_slurm import check_listeners

pytestmark = pytest.mark.slurm

ASK_TEMPLATE = r"""
import json, os, urllib.request
url = json.loads(os.environ["SLURMGATE_ENDPOINTS"])[%(name)r]
for i in range(3):
    body = json.dumps({"model": "stub", "prompt": f"hi {i}", "max_tokens": 3}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["choices"]
print("client: 3 completions through", url, flush=True)
"""


def ask_client(deployment: str) -> str:
    """A client that asks the deployment's endpoint for three completions of the stub."""
    return ASK_TEMPLATE % {"name": deployment}


ASK = ask_client("trt")

# The client kills rank 3's process (a rank that serves nothing: rank 0 is the server) on
# whichever node it runs, then waits: the run must fail on the rank's death, not on the client.
KILL_RANK_3 = r"""
import os, signal, time
run_id = os.environ["SLURMGATE_RUN_ID"].encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        continue
    lane = [e for e in env if e.startswith(b"SLURMGATE_RUN_LANE=")]
    if b"SLURMGATE_RUN_ID=" + run_id in env and lane and lane[0].endswith(b"-mpi-rank-00003"):
        os.kill(int(pid), signal.SIGKILL)
        print("killed rank 3, pid", pid, flush=True)
time.sleep(120)
"""


def _spec(name: str, client: str) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": name,
            "gpus_per_node": 2,
            "time_limit": "00:05:00",
            "client": {"command": [sys.executable, "-c", client], "dedicated_node": True},
            "deployments": [
                {
                    "name": "trt",
                    "engine": "trtllm",
                    "command": [sys.executable, "-m", "slurmgate.testbed.stub_server"],
                    "mpi_launch": [sys.executable, "-m", "slurmgate.testbed.mpi_launch"],
                    # ranks that wait give the 2 cores back
                    "env": {"OMPI_MCA_mpi_yield_when_idle": "1"},
                    "roles": {"agg": {"workers": 1, "tensor_parallel": 4}},
                    "base_port": 18800,
                    "endpoint_port": 17800,
                    "startup_timeout_s": 60,
                }
            ],
        },
        source="test",
    )


def _left(run: AllocationRun, job: str) -> None:
    """No step of the run in Slurm, no process of it on the machine."""
    assert not [s for s in slurm.list_steps(job) if s.name.startswith(run.run_id)]
    assert processes_with_env("SLURMGATE_RUN_ID", run.run_id) == []


def test_a_worker_over_two_nodes_forms_one_world_and_rank_0_serves(
    runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation(nodes=3, gpus=8)
    hosts = hosts_of(job)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    lines: list[str] = []
    spec = _spec("mpi-serve", ASK + HOLD_FOR_LISTENER_WATCH)
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5, log=lines.append)
    with ListenerWatch() as listeners:
        run.run()
    assert run.status == "succeeded"
    # the ranks' listeners are the README's `mpi` row, the head's the `lane` row
    check_listeners(listeners, spec, run, {"endpoint", "lane", "mpi"})
    assert any(line.startswith("decision: launch trt's agg worker 0 as one MPI world of 4 ranks")
               for line in lines), lines  # fmt: skip
    world_log = next(run.run_dir.glob("*-serve-trt-mpi-agg-00000.log")).read_text()
    reports = re.findall(r"mpi-launch: rank (\d) of (\d) on (\S+)", world_log)
    assert sorted(int(r) for r, _, _ in reports) == [0, 1, 2, 3], world_log[-3000:]
    assert {size for _, size, _ in reports} == {"4"}
    # two ranks on each of the world's two nodes, which are not the client's
    on = [host for _, _, host in reports]
    assert set(on) == set(hosts[1:]) and all(on.count(h) == 2 for h in on), reports
    assert "mpi-launch: world of 4: 0@" in world_log
    client_log = next(run.run_dir.glob("*-client.log")).read_text()
    assert "client: 3 completions through" in client_log
    _left(run, job)


def test_a_killed_rank_fails_the_run_naming_it_and_no_rank_survives(
    runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation(nodes=3, gpus=8)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    run = AllocationRun(_spec("mpi-kill", KILL_RANK_3), runs_root=runs_root, grace_s=5)
    with pytest.raises(RunFailed) as info:
        run.run()
    message = str(info.value)
    # the rank's lane and node, not the client's 120 s wait
    assert re.search(r"lane trt-agg-00000-rank-00000-mpi-rank-00003 on node \S+ exited", message), (
        message[-3000:]
    )
    assert run.cleaned and run.status == "failed"
    _left(run, job)
