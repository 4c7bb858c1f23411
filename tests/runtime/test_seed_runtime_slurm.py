"""The seed's runtime behaviours on the real cluster: probes from the client host, fail-fast
serve steps, and client-side failures (preflight, endpoint, client) that clean up fully."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm

from .conftest import assert_no_orphans, hosts_of, job_gone, port_held

pytestmark = pytest.mark.slurm

# A lane that answers only the allocation's first node (the client host), the way a site's
# firewall answers nobody outside the compute nodes, and logs who probed it. It takes the
# layout's flags (--host/--port and the parallel sizes) as `vllm serve` would.
CLIENT_HOST_ONLY_LANE = r"""
import http.server, json, os, subprocess, sys, threading
log_lock = threading.Lock()  # print() writes text and newline apart: threads interleave them
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
def scontrol(*a):
    return subprocess.run(["scontrol", *a], capture_output=True, text=True, check=True).stdout
def fields(text):
    return dict(f.split("=", 1) for f in text.split() if "=" in f)
job = fields(scontrol("show", "job", "-o", os.environ["SLURM_JOB_ID"]))
first = scontrol("show", "hostnames", job["NodeList"]).split()[0]
allowed = fields(scontrol("show", "node", "-o", first))["NodeAddr"]
print(f"answering {first} at {allowed} only", file=sys.stderr, flush=True)
class Lane(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        peer = self.client_address[0]
        status = 200 if peer == allowed else 403
        body = json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode()
        with log_lock:
            print(f"GET {self.path} from {peer}: {status}", file=sys.stderr, flush=True)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer((host, port), Lane).serve_forever()
"""

# The client finds its run's endpoint process on this node and kills it, then waits: the run
# must notice the dead endpoint step and fail, not wait for the client.
ENDPOINT_KILLER = r"""
import os, signal, time
run_id = os.environ["SLURMGATE_RUN_ID"].encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        env = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        continue
    argv = cmd.split(b"\0")
    mine = b"SLURMGATE_RUN_ID=" + run_id in env
    if mine and argv[1:3] == [b"-m", b"slurmgate.runtime.endpoint"]:  # the task, not its srun
        os.kill(int(pid), signal.SIGKILL)
        print("killed endpoint", pid, flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def _deployment(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "command": command,
        "replicas": 1,
        "lanes_per_node": 1,
        "gpus_per_node": 1,
        "base_port": 18700,
        "rendezvous_base_port": 19700,
        "endpoint_port": 17700,
        "startup_timeout_s": 30,
        "distributed_timeout_s": 20,
        "ready_probes": 1,
        "lead_boot_standoff_s": 0,
        "rank_launch_stagger_s": 0,
        **extra,
    }


def _spec(
    name: str, client: list[str], deployment: dict[str, Any], dedicated: bool = False, **top: Any
) -> AllocationSpec:
    data = {
        "schema_version": 1,
        "name": name,
        "gpus_per_node": 8,
        "time_limit": "00:05:00",
        "client": {"command": client, "dedicated_node": dedicated},
        "deployments": [deployment],
        **top,
    }
    return AllocationSpec.from_data(data, source="test")


def _failed(run: AllocationRun, phase: str) -> str:
    with pytest.raises(RunFailed) as info:
        run.run()
    assert info.value.phase == phase, str(info.value)
    assert run.status == "failed" and run.cleaned
    record = json.loads(run.record_path.read_text())
    assert record["status"] == "failed" and record["cleanup_complete"] is True
    assert record["error"] and f"RunFailed: {phase}:" in record["error"]
    return str(info.value)


def test_probes_run_on_the_client_host_and_a_client_exit_23_fails_the_run(
    runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller (here, off the allocation) cannot get an answer from the lane; the
    client host can. Also: 8 visible GPUs serve a plan of 4, and the client's exit 23 fails
    the run, which cleans up without cancelling an allocation it does not own."""
    job = held_allocation(nodes=2, gpus=8)
    hosts = hosts_of(job)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    spec = _spec(
        "probe-origin",
        ["sh", "-c", "echo client ran; exit 23"],
        _deployment("gated", [sys.executable, "-c", CLIENT_HOST_ONLY_LANE]),
        dedicated=True,
        gpus_per_node=4,
    )
    lines: list[str] = []
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5, log=lines.append)
    message = _failed(run, "client")
    assert "client exited 23" in message and "client ran" in message
    client_host, lane_host = hosts
    assert run.layout is not None and run.layout.client_host == client_host
    # The probes came from the client host, through one step that served every poll.
    assert run.probe_origin == client_host
    assert any(
        line.startswith(f"decision: probes run on the client host {client_host} in one step")
        for line in lines
    ), lines
    probe_steps = [s for s in run.supervisor.records() if s["name"] == "probe"]
    assert len(probe_steps) == 1  # the lanes' and the endpoint's readiness: one step
    assert all(s["step_name"] == f"{run.run_id}-probe" for s in probe_steps)
    serve_log = next(run.run_dir.glob("*-serve-gated.log")).read_text()
    client_address = slurm.node_address(client_host)
    probes = [line for line in serve_log.splitlines() if line.startswith("GET /health from")]
    assert probes and all(p == f"GET /health from {client_address}: 200" for p in probes), (
        serve_log[-2000:]
    )
    # The node showed 8 GPUs to a plan of 4: preflight took the superset.
    preflight_log = next(run.run_dir.glob("*-preflight-gated.log")).read_text()
    assert f"SLURMGATE-PREFLIGHT-OK host={lane_host} cpus=" in preflight_log
    assert "gpus=8" in preflight_log
    # The allocation is not the run's: it stays, and none of the run's steps do.
    info = slurm.show_job(job)
    assert info is not None and info.active
    assert not [s for s in slurm.list_steps(job) if s.name.startswith(run.run_id)]
    assert_no_orphans(run.run_id)


def test_a_serve_step_ends_on_one_nodes_bad_exit(runs_root: Path) -> None:
    """Rank 1 exits 3 while rank 0 would sleep on: only Slurm's --kill-on-bad-exit ends the
    step (without it the run would wait out the 30 s startup deadline)."""
    lane = [
        "sh",
        "-c",
        'case "$*" in *"--node-rank 1"*) sleep 1; exit 3;; esac; exec sleep 300',
        "lane",
    ]
    spec = _spec(
        "bad-exit",
        ["true"],
        _deployment("split", lane, pipeline_parallel=2, nodes_per_replica=2),
    )
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5)
    t0 = time.monotonic()
    message = _failed(run, "readiness")
    assert time.monotonic() - t0 < 20, message
    assert "required step serve-split exited with status" in message
    assert "not ready by the startup deadline" not in message
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_an_endpoint_that_dies_mid_run_fails_the_run_at_once(runs_root: Path) -> None:
    spec = _spec(
        "endpoint-dies",
        [sys.executable, "-c", ENDPOINT_KILLER],
        _deployment("chat", [sys.executable, "-m", "slurmgate.testbed.stub_server"]),
    )
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5)
    t0 = time.monotonic()
    message = _failed(run, "client")
    assert time.monotonic() - t0 < 30, message
    assert "required step endpoint-chat exited with status" in message
    client_log = next(run.run_dir.glob("[0-9][0-9]-client.log")).read_text()
    assert "killed endpoint" in client_log  # the client was still waiting when the run ended
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_a_client_preflight_that_exits_23_launches_nothing(runs_root: Path, tmp_path: Path) -> None:
    # A `python` that fails the client's preflight task (exit 23, no report) and is the real
    # interpreter for everything else.
    wrapper = tmp_path / "bin" / "python"
    wrapper.parent.mkdir()
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "if sys.argv[1:4] == ['-m', 'slurmgate.runtime.steps.node_worker', 'preflight'] and "
        "os.environ.get('SLURM_JOB_NAME', '').endswith('-preflight-client'):\n"
        "    print('client preflight: exit 23', file=sys.stderr)\n"
        "    sys.exit(23)\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    wrapper.chmod(0o755)
    spec = _spec(
        "client-preflight-23",
        ["true"],
        _deployment("chat", [sys.executable, "-m", "slurmgate.testbed.stub_server"]),
    )
    run = AllocationRun(spec, runs_root=runs_root, grace_s=5, python=str(wrapper))
    message = _failed(run, "preflight")
    assert "preflight-client exited 23" in message and "client preflight: exit 23" in message
    assert [s.name for s in run.supervisor.steps] == ["preflight-client"]  # nothing else ran
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)


def test_a_busy_endpoint_port_fails_the_client_preflight(
    runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = held_allocation(nodes=1)
    hosts = hosts_of(job)
    with port_held(job, hosts[0], 17710):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        spec = _spec(
            "client-port",
            ["true"],
            _deployment(
                "chat",
                [sys.executable, "-m", "slurmgate.testbed.stub_server"],
                endpoint_port=17710,
            ),
        )
        run = AllocationRun(spec, runs_root=runs_root, grace_s=5)
        message = _failed(run, "preflight")
        assert f"node {hosts[0]}: check port: port 17710 is not bindable" in message
        assert [s.name for s in run.supervisor.steps] == ["preflight-client"]
        assert_no_orphans(run.run_id)
