"""Dynamo for real on the cluster: its frontend and mocker workers, behind the run's services.

A dynamo-sglang deployment with `stand_in: dynamo-mocker`: one prefill and one decode mocker on
two nodes of their own, Dynamo's real frontend, etcd and NATS (mutual TLS across hosts; NATS is
the event plane too) on the client node, slurmgate's endpoint in front. The client sends plain
and streamed chat completions through the endpoint and reads each worker's own count of the
requests it served. With etcd it then SIGKILLs the decode mocker mid-stream: the stream ends
with an error event, the run fails at once naming the lane and its node. With file discovery
the run succeeds and itself reads what each worker served. Nothing is left on any node.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import REPO, assert_no_orphans, job_gone, processes_with
from .listeners import ListenerWatch
from .test_pd_slurm import check_listeners

pytestmark = pytest.mark.slurm

DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
SIDE = 18960  # the mocker's request plane at +0, its status server (/metrics) at +1
DECODE_LANE = "dyn-decode-00000-rank-00000"

CLIENT = r"""
import json, os, signal, time, urllib.request
base = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["dyn"]
addresses, system_port, lane, kill = json.loads(%(args)r)

def served():
    # every worker's own count of the requests its generate endpoint served, by component
    out = {}
    for address in addresses:
        try:
            with urllib.request.urlopen(f"http://{address}:{system_port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            generate = 'dynamo_endpoint="generate"' in line
            if line.startswith("dynamo_component_requests_total{") and generate:
                component = line.split('dynamo_component="', 1)[1].split('"', 1)[0]
                out[f"{address} {component}"] = float(line.rsplit(" ", 1)[1])
    return out

def chat(content, stream=False, max_tokens=4):
    body = {"model": "dyn", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=30)

out = {"before": served()}
out["plain"] = []
for i in range(3):
    with chat(f"hello {i}") as r:
        out["plain"].append([r.status, json.loads(r.read())["choices"][0]["message"]["content"]])
with chat("stream me", stream=True) as r:
    out["stream"] = [r.status, r.headers.get("Content-Type"), r.read().decode()]
out["after"] = served()
with urllib.request.urlopen(base + "/metrics", timeout=10) as r:  # the endpoint's own
    out["sampling"] = [x for x in r.read().decode().splitlines()
                       if x.startswith(("slurmgate_backend_sample_failed_open{",
                                        "slurmgate_backend_queue_depth{"))]
print("RESULT " + json.dumps(out), flush=True)
if not kill:
    raise SystemExit(0)

# the decode mocker's process: the lane of this run whose environment names it
me = os.environ["SLURMGATE_RUN_ID"].encode()
def decode_pid():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"SLURMGATE_RUN_ID=" + me in env and f"SLURMGATE_RUN_LANE={lane}".encode() in env:
            if b"dynamo.mocker" in open(f"/proc/{pid}/cmdline", "rb").read():
                return int(pid)

r = chat("a long one", stream=True, max_tokens=4000)
first = r.readline().decode()
while not first.startswith("data:"):
    first = r.readline().decode()
pid = decode_pid()
print("KILLING", pid, time.time(), flush=True)
os.kill(pid, signal.SIGKILL)
t0 = time.time()
rest = r.read().decode(errors="replace")
print("STREAM_END " + json.dumps({"after_s": time.time() - t0, "tail": rest[-300:]}), flush=True)
time.sleep(60)  # the run must not wait for this
"""


def dynamo_spec(addresses: list[str], discovery: str, kill: bool) -> AllocationSpec:
    args = json.dumps([addresses, SIDE + 1, DECODE_LANE, kill])
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "dyn",
            "gpus_per_node": 8,
            "time_limit": "00:03:00",
            "client": {
                "command": ["python", "-c", CLIENT % {"args": args}],
                "dedicated_node": True,
            },
            "deployments": [
                {
                    "name": "dyn",
                    "engine": "dynamo-sglang",
                    "stand_in": "dynamo-mocker",
                    "command": [str(DYNAMO_PYTHON), "-m", "dynamo.mocker"],
                    "roles": {
                        "prefill": {"args": ["--speedup-ratio", "0"]},
                        # slow enough that a long stream is still running when it is killed
                        "decode": {"args": ["--speedup-ratio", "0.2"]},
                    },
                    "frontend": {
                        "type": "dynamo",
                        "command": [str(DYNAMO_PYTHON), "-m", "dynamo.frontend"],
                        "discovery": discovery,
                        "port": 17740,
                        "etcd_port": 18990,
                        "nats_port": 18992,
                        "nats_monitor_port": 18993,
                        "startup_timeout_s": 60,
                    },
                    "base_port": 18940,
                    "bootstrap_base_port": 18950,
                    "side_base_port": SIDE,
                    "endpoint_port": 17742,
                    "startup_timeout_s": 60,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                },
            ],
        },
        source="test",
    )


@pytest.mark.parametrize(
    ("discovery", "kill"),
    [("etcd", True), ("file", False)],
    ids=["etcd-decode-killed", "file-discovery"],
)
def test_dynamo_mocker_serves_through_the_endpoint(
    discovery: str,
    kill: bool,
    slurm_cluster: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not DYNAMO_PYTHON.exists():
        pytest.skip("no Dynamo venv (.venv-dynamo): scripts/setup.sh with SLURMGATE_WITH_DYNAMO=1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    watch = ListenerWatch()
    spec = dynamo_spec(sorted(watch.namespaces.values()), discovery, kill)
    run = AllocationRun(spec, runs_root=tmp_path / "runs", grace_s=5)
    failure: RunFailed | None = None
    try:
        with watch as listeners:
            try:
                run.run()
            except RunFailed as exc:
                failure = exc
        ended = time.time()
    finally:
        assert_no_orphans(run.run_id)
    assert run.cleaned and job_gone(run.job_id)
    assert run.layout is not None
    logs = {p.name.split("-", 1)[1]: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    client = logs["client.log"]
    line = next((x for x in client.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, client[-3000:]
    report: dict[str, Any] = json.loads(line[len("RESULT ") :])
    for status, text in report["plain"]:
        assert status == 200 and text.strip(), report["plain"]
    status, kind, body = report["stream"]
    assert status == 200 and kind.startswith("text/event-stream"), body
    assert body.count("data: {") >= 2 and body.rstrip().endswith("data: [DONE]"), body
    # each worker counted the requests it served (4 each: one prefill and one decode apiece)
    prefill, decode = (run.layout.address(n) for n in (1, 2))
    after = report["after"]
    assert after.get(f"{prefill} prefill", 0) >= 4, report
    assert after.get(f"{decode} backend", 0) >= 4, report
    assert all(report["before"].get(k, 0) < v for k, v in after.items()), report
    # the endpoint's backpressure reads the frontend's own queue gauge: sampled, not failed open
    sampling = dict(line.rsplit(" ", 1) for line in report["sampling"])
    assert [v for k, v in sampling.items() if "failed_open" in k] == ["0.0"], sampling
    depth = [float(v) for k, v in sampling.items() if "queue_depth" in k]
    assert depth and depth[0] >= 0, sampling  # a number: NaN when no sample ever came
    if kill:
        # the killed decode: the stream ended with an error event at once, and the run failed
        # fast, naming the lane and its node
        assert failure is not None and failure.phase == "client", failure
        assert run.status == "failed"
        lines = client.splitlines()
        killed = float(next(x for x in lines if x.startswith("KILLING")).split()[2])
        end = json.loads(next(x for x in lines if x.startswith("STREAM_END "))[11:])
        assert end["after_s"] < 10 and '"error"' in end["tail"], end
        assert ended - killed < 15, f"the run took {ended - killed:.1f}s to notice"
        message = str(failure)
        assert f"lane {DECODE_LANE} on node {run.layout.host(2)} exited" in message, message
    else:
        # the run itself read each worker's count before stopping it, into its record
        assert failure is None and run.status == "succeeded", failure
        served = json.loads((run.run_dir / "record.json").read_text())["lane_served"]
        assert served.get("dyn-prefill-00000-rank-00000", 0) >= 4, served
        assert served.get(DECODE_LANE, 0) >= 4, served
    # nothing of Dynamo, etcd or NATS is left, nor a lane's directory (etcd's and NATS's
    # data, the certificates); every node of the bundled cluster shares this /tmp
    left = processes_with("dynamo.") + processes_with("etcd") + processes_with("nats-server")
    assert not [p for p in left if run.run_id in p], left
    assert not list(Path(tempfile.gettempdir()).glob(f"slurmgate-{run.run_id}-*"))
    serve = logs["serve-dyn.log"] + logs["services-dyn.log"]
    assert "started lane dyn-decode-00000-rank-00000 pid" in serve, serve[-2000:]
    expected = {"endpoint", "side", "frontend", "frontend-response-stream", "nats"}
    if discovery == "etcd":
        expected |= {"etcd", "etcd-peer"}
    else:
        # the records were in the run's directory, which cleanup removed (a killed worker's
        # would stay until they expire), and no etcd ran
        kv = run.run_dir / "discovery-dyn"
        cleanup = run.context.cleanup_report
        assert cleanup is not None
        assert f"removed dyn's discovery directory {kv.resolve()}" in cleanup.actions, cleanup
        assert not kv.exists()
    check_listeners(listeners, spec, run, expected)
