"""Disaggregated deployments of the stub engine on the real cluster, in one allocation.

Four nodes, the client on the first: deployment `pd` is 2P+1D (two prefill workers of 4 GPUs
sharing node 0, each on its own GPU slice and port; one decode worker on node 1) behind our
PD endpoint; deployment `router` is 1P+1D (nodes 2 and 3) behind the real sglang-router in PD
mode, which the runtime starts on the client node and the endpoint fronts. The same client
sends the same completions, plain and streamed, through both; every answer is paired (the
decode lanes logged exactly the bootstrap rooms the prefill lanes logged). Then the router's
prefill worker dies (it crashes after its fifth request) while the client still runs: the run
fails within seconds, names the node and the lane, and cleanup leaves nothing on any node.

A Dynamo deployment (stub workers on two nodes, a stand-in frontend) runs Debian's real etcd and
NATS as its service lanes on the client node, behind the run's own mutual TLS: the frontend
reaches both with the certificate files the runtime gave its lane; the client, an outsider to
them, reads their health on loopback and NATS's INFO, and is refused by both; cleanup leaves
neither behind.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import assert_no_orphans, job_gone, processes_with
from .listeners import HOLD_FOR_LISTENER_WATCH, ListenerWatch, kind_of, unlisted

pytestmark = pytest.mark.slurm

CLIENT = r"""
import json, os, time, urllib.request
bases = json.loads(os.environ["SLURMGATE_ENDPOINTS"])

def post(base, payload):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()

out = {}
for name in ("pd", "router"):
    plain = [post(bases[name], {"model": "stub", "prompt": f"p{i}", "max_tokens": 3})
             for i in range(3)]
    streamed = post(bases[name], {"model": "stub", "prompt": "s", "max_tokens": 3, "stream": True})
    out[name] = {"plain": plain, "stream": streamed}
with urllib.request.urlopen(bases["pd"] + "/metrics", timeout=10) as r:
    out["pd_routed"] = [x for x in r.read().decode().splitlines()
                        if x.startswith("slurmgate_backend_requests_total{")]
print("RESULT " + json.dumps(out), flush=True)
# said before the request that kills the prefill: the run may stop this client before the
# request returns, and on a fresh machine it did
print("DYING", time.time(), flush=True)
try:
    post(bases["router"], {"model": "stub", "prompt": "last", "max_tokens": 1})  # its fifth
except Exception as exc:
    print(f"fifth request failed: {exc}", flush=True)
time.sleep(60)  # the run must not wait for this
"""

STUB = ["python", "-m", "slurmgate.testbed.stub_server", "--model", "stub"]
ROOMS = {"SLURMGATE_STUB_LOG_ROOMS": "1"}


def pd_spec() -> AllocationSpec:
    fast = {"SLURMGATE_STUB_TOKENS_PER_SECOND": "0"}
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "pd",
            "gpus_per_node": 8,
            "time_limit": "00:03:00",
            "client": {"command": ["python", "-c", CLIENT], "dedicated_node": False},
            "deployments": [
                {
                    "name": "pd",
                    "engine": "custom",
                    "command": STUB,
                    "env": fast,
                    "roles": {
                        "prefill": {"workers": 2, "tensor_parallel": 4, "env": ROOMS},
                        "decode": {"env": ROOMS},
                    },
                    "base_port": 18700,
                    "bootstrap_base_port": 18710,
                    "side_base_port": 18720,
                    "endpoint_port": 17700,
                    "startup_timeout_s": 60,
                    # stub lanes boot in a second: no standoff before the second worker
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                },
                {
                    "name": "router",
                    "engine": "custom",
                    "command": STUB,
                    "env": fast,
                    "roles": {
                        "prefill": {"env": {**ROOMS, "SLURMGATE_STUB_CRASH_AFTER": "5"}},
                        "decode": {"env": ROOMS},
                    },
                    "frontend": {
                        "type": "sglang-router",
                        "port": 17710,
                        "args": ["--worker-startup-check-interval", "1", "--log-level", "warn"],
                        "startup_timeout_s": 60,
                    },
                    "base_port": 18800,
                    "bootstrap_base_port": 18810,
                    "side_base_port": 18820,
                    "endpoint_port": 17701,
                    "startup_timeout_s": 60,
                },
            ],
        },
        source="test",
    )


def rooms(log: str, side: str) -> list[int]:
    return [int(r) for r in re.findall(rf"stub_server: {side} bootstrap_room (\d+)", log)]


def test_2p1d_endpoint_and_1p1d_sglang_router_pair_requests_and_a_dying_prefill_fails_fast(
    slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    spec = pd_spec()
    run = AllocationRun(spec, runs_root=tmp_path / "runs", grace_s=5)
    try:
        with ListenerWatch() as listeners, pytest.raises(RunFailed) as failed:
            run.run()
        ended = time.time()
    finally:
        assert_no_orphans(run.run_id)
    assert failed.value.phase == "client", str(failed.value)
    assert run.status == "failed" and run.cleaned
    assert job_gone(run.job_id)
    assert run.layout is not None
    logs = {p.name.split("-", 1)[1]: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    client = logs["client.log"]
    line = next(x for x in client.splitlines() if x.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line[len("RESULT ") :])
    for name in ("pd", "router"):
        for status, kind, body in report[name]["plain"]:
            assert (status, kind) == (200, "application/json"), (name, body)
            assert json.loads(body)["choices"][0]["text"] == "tok0 tok1 tok2 "
        status, kind, body = report[name]["stream"]
        assert status == 200 and kind.startswith("text/event-stream"), (name, body)
        assert body.count("data: {") == 3 and body.rstrip().endswith("data: [DONE]")
    # 2P+1D: the two prefill workers share node 0 on their own GPU slices and ports, and
    # the endpoint sent each of them requests
    serve_pd = logs["serve-pd.log"]
    assert re.search(r"started lane pd-prefill-00000-rank-00000 pid \d+ gpus 0,1,2,3\b", serve_pd)
    assert re.search(r"started lane pd-prefill-00001-rank-00000 pid \d+ gpus 4,5,6,7\b", serve_pd)
    head = run.layout.address(0)
    routed = {
        port: float(x.rsplit(" ", 1)[1])
        for x in report["pd_routed"]
        for port in ("18700", "18701")
        if f'backend="http://{head}:{port}"' in x
    }
    assert routed.keys() == {"18700", "18701"} and min(routed.values()) >= 1, report["pd_routed"]
    # every answer was paired: each deployment's decode confirmed exactly the rooms its
    # prefills ran (our endpoint's rooms and sglang-router's alike)
    for name, expected in (("pd", 4), ("router", 4)):
        prefilled = rooms(logs[f"serve-{name}.log"], "prefill")[:expected]
        decoded = rooms(logs[f"serve-{name}.log"], "decode")[:expected]
        assert len(set(prefilled)) == expected and sorted(decoded) == sorted(prefilled), name
    # the router ran as a service lane on the client node, bound to its address
    assert "started lane router-frontend pid" in logs["frontend-router.log"]
    # the prefill worker's death ends the run long before the client's 60 s sleep, and the
    # report names the lane and its node
    dying = float(next(x for x in client.splitlines() if x.startswith("DYING")).split()[1])
    assert ended - dying < 15, f"the run took {ended - dying:.1f}s to notice"
    message = str(failed.value)
    host = run.layout.host(2)
    assert f"lane router-prefill-00000-rank-00000 on node {host} exited" in message, message
    check_listeners(listeners, spec, run, {"endpoint", "lane", "bootstrap", "frontend"})


def check_listeners(
    watch: ListenerWatch, spec: AllocationSpec, run: AllocationRun, expected: set[str]
) -> None:
    """Every socket the run listened on in a node's namespace is in the README's table, bound
    where the table says; and the watch saw the listeners this run must have opened."""
    if not watch.namespaces:
        pytest.skip("listeners: the bundled cluster runs without a namespace per node")
    assert run.layout is not None
    assert not unlisted(watch, spec, run.layout), "\n".join(unlisted(watch, spec, run.layout))
    seen = {kind_of(spec, run.layout, x) for x in watch.new}
    assert expected <= seen, f"expected {expected}, saw {seen}"


# A stand-in for Dynamo's frontend (`frontend.command`): it answers /health listing one
# prefill and one decode instance only once the real etcd and NATS lanes answer it at the
# addresses the runtime gives it (ETCD_ENDPOINTS, NATS_SERVER), through mutual TLS with the
# certificate its lane was given as Dynamo's runtime reads it: NATS_TLS_* name its files,
# ETCD_AUTH_* hold their text in its process (C's getenv, as Rust reads it), set there by the
# lane launcher, never in the environment it was exec'd with.
DYNAMO_FRONTEND = r"""
import base64, ctypes, json, os, socket, ssl, sys, time, urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
host = sys.argv[sys.argv.index("--http-host") + 1]
port = int(sys.argv[sys.argv.index("--http-port") + 1])
etcd, nats = os.environ["ETCD_ENDPOINTS"], os.environ["NATS_SERVER"]
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
with open("/proc/self/environ", "rb") as f:
    execd = f.read()
for var, path in (("CA", "CA_CERT"), ("CLIENT_CERT", "CLIENT_CERT"), ("CLIENT_KEY", "CLIENT_KEY")):
    with open(os.environ[f"NATS_TLS_{path}_PATH"]) as f:
        assert getenv(f"ETCD_AUTH_{var}".encode()).decode() == f.read(), var
    assert f"ETCD_AUTH_{var}=".encode() not in execd, var
tls = ssl.create_default_context(cafile=os.environ["NATS_TLS_CA_CERT_PATH"])
tls.load_cert_chain(
    os.environ["NATS_TLS_CLIENT_CERT_PATH"], os.environ["NATS_TLS_CLIENT_KEY_PATH"]
)
nats_tls = ssl.create_default_context(cafile=os.environ["NATS_TLS_CA_CERT_PATH"])
nats_tls.load_cert_chain(
    os.environ["NATS_TLS_CLIENT_CERT_PATH"], os.environ["NATS_TLS_CLIENT_KEY_PATH"]
)
b64 = lambda s: base64.b64encode(s.encode()).decode()
while True:
    try:
        with urllib.request.urlopen(etcd + "/health", timeout=2, context=tls) as r:
            health = json.loads(r.read())
        put = urllib.request.Request(
            etcd + "/v3/kv/put", data=json.dumps({"key": b64("k"), "value": b64("v")}).encode()
        )
        with urllib.request.urlopen(put, timeout=2, context=tls) as r:
            stored = r.status == 200
        host, nport = nats.removeprefix("tls://").rsplit(":", 1)
        with socket.create_connection((host, int(nport)), timeout=2) as raw:
            raw.makefile("rb").readline()
            with nats_tls.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(b'CONNECT {"verbose":false,"tls_required":true}\r\nPING\r\n')
                pong = s.recv(64)
        if health.get("health") == "true" and stored and pong.startswith(b"PONG"):
            break
    except OSError:
        pass
    time.sleep(0.2)
print(f"frontend saw etcd {etcd} and nats {nats}", flush=True)
instances = [{"endpoint": "generate", "component": c} for c in ("prefill", "decode")]

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "healthy", "instances": instances}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

HTTPServer((host, port), Health).serve_forever()
"""

# The client is an outsider to the services (it has no certificate of the run): on the client
# node it reads etcd's /health and NATS's monitor on loopback, and NATS's INFO line on the node's
# address; etcd refuses its write over TLS and plain HTTP, NATS its TLS upgrade.
SERVICES_CLIENT = r"""
import base64, json, os, socket, ssl, urllib.request
base = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["dyn"]
host = base.removeprefix("http://").rsplit(":", 1)[0]

def call(url, payload=None, context=None):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data)
    with urllib.request.urlopen(req, timeout=5, context=context) as r:
        return r.status, json.loads(r.read())

def refused(fn):
    try:
        return f"answered {fn()!r}"
    except Exception as exc:
        return f"refused {type(exc).__name__}"

b64 = lambda s: base64.b64encode(s.encode()).decode()
put = {"key": b64("/services/outsider"), "value": b64("x")}
loose = ssl.create_default_context()
loose.check_hostname, loose.verify_mode = False, ssl.CERT_NONE
out = {"etcd_health": call("http://127.0.0.1:%(etcd)d/health")}
out["etcd_put_tls"] = refused(lambda: call(f"https://{host}:%(etcd)d/v3/kv/put", put, loose))
out["etcd_put_plain"] = refused(lambda: call(f"http://{host}:%(etcd)d/v3/kv/put", put))
with socket.create_connection((host, %(nats)d), timeout=5) as raw:
    out["nats_info"] = json.loads(raw.makefile("rb").readline().decode().removeprefix("INFO "))

    def subscribe():
        with loose.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(b'CONNECT {"verbose":false,"tls_required":true}\r\nSUB > 1\r\nPING\r\n')
            answer = s.recv(64)
            if not answer.startswith(b"PONG"):
                raise ConnectionError(answer.decode(errors="replace"))
            return answer.decode()

    out["nats_sub"] = refused(subscribe)
out["nats_healthz"] = call("http://127.0.0.1:%(nats_monitor)d/healthz")
print("RESULT " + json.dumps(out), flush=True)
"""

SERVICE_PORTS = {"etcd": 18930, "nats": 18932, "nats_monitor": 18933}


def dynamo_spec() -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "dyn",
            "gpus_per_node": 8,
            "time_limit": "00:03:00",
            "client": {
                "command": [
                    "python",
                    "-c",
                    SERVICES_CLIENT % SERVICE_PORTS + HOLD_FOR_LISTENER_WATCH,
                ],
                "dedicated_node": False,
            },
            "deployments": [
                {
                    "name": "dyn",
                    "engine": "dynamo-sglang",
                    "command": STUB,
                    "roles": {"prefill": {}, "decode": {}},
                    "frontend": {
                        "type": "dynamo",
                        "command": ["python", "-c", DYNAMO_FRONTEND],
                        "port": 17720,
                        "etcd_port": SERVICE_PORTS["etcd"],
                        "nats_port": SERVICE_PORTS["nats"],
                        "nats_monitor_port": SERVICE_PORTS["nats_monitor"],
                        "etcd_command": ["etcd"],
                        "nats_command": ["nats-server"],
                        "startup_timeout_s": 30,
                    },
                    "base_port": 18900,
                    "bootstrap_base_port": 18910,
                    "side_base_port": 18920,
                    "endpoint_port": 17722,  # 17721: the frontend's response-stream port
                    "startup_timeout_s": 30,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                },
            ],
        },
        source="test",
    )


def test_dynamo_deployment_runs_real_etcd_and_nats_as_service_lanes(
    slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    spec = dynamo_spec()
    run = AllocationRun(spec, runs_root=tmp_path / "runs", grace_s=5)
    try:
        with ListenerWatch() as listeners:
            run.run()
    finally:
        assert_no_orphans(run.run_id)
    assert run.status == "succeeded" and run.cleaned, run.status
    assert job_gone(run.job_id)
    assert run.layout is not None
    head = run.layout.address(run.layout.plan.client_node)
    logs = {p.name.split("-", 1)[1]: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    line = next(x for x in logs["client.log"].splitlines() if x.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line[len("RESULT ") :])
    assert report["etcd_health"] == [200, {"health": "true"}], report
    # an outsider without the run's certificate can neither write etcd nor subscribe on NATS
    assert report["etcd_put_tls"].startswith("refused"), report
    assert report["etcd_put_plain"].startswith("refused"), report
    assert report["nats_sub"].startswith("refused"), report
    assert report["nats_info"]["port"] == SERVICE_PORTS["nats"], report["nats_info"]
    assert report["nats_info"]["jetstream"] is True, report["nats_info"]
    assert report["nats_info"]["tls_required"] is True, report["nats_info"]
    assert report["nats_healthz"] == [200, {"status": "ok"}], report
    # both ran as lanes of the services step on the client node, before the workers, and the
    # frontend found them at the addresses the runtime handed it
    services = logs["services-dyn.log"]
    assert "started lane dyn-etcd pid" in services and "started lane dyn-nats pid" in services
    etcd = f"https://{head}:{SERVICE_PORTS['etcd']}"
    nats = f"tls://{head}:{SERVICE_PORTS['nats']}"
    assert f"frontend saw etcd {etcd} and nats {nats}" in logs["frontend-dyn.log"]
    # nothing of either is left on any node (every node of the bundled cluster is this host)
    left = processes_with("etcd") + processes_with("nats-server")
    assert not [p for p in left if run.run_id in p or str(SERVICE_PORTS["etcd"]) in p], left
    expected = {"endpoint", "lane", "frontend", "etcd", "etcd-health", "etcd-peer", "nats"}
    check_listeners(listeners, spec, run, expected | {"nats-monitor"})
