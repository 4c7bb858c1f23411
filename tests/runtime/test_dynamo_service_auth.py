"""Dynamo's real frontend and mocker over mutual TLS to a real etcd and NATS, started by the node
worker as a run starts them across hosts, without Slurm: the key never in exec's environment.

etcd and nats-server (Debian's) listen on 127.0.0.2 with the run's certificates, as the client
node's services do. A real node worker (`python -m slurmgate.runtime.steps.node_worker serve`,
its spec on stdin, its output in a step log as the supervisor keeps it) starts an agg mocker
and the frontend from `.venv-dynamo` with the run's client certificate as shared files and
ETCD_AUTH_* as env_files, the env `layout` gives Dynamo's lanes with TLS. Each goes through the
lane launcher, which sets ETCD_AUTH_* inside its process: the mocker registers in etcd, the
frontend lists and serves the model, and no process of either lane holds PEM text in
/proc/PID/environ or its argv; nor does the step's log.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurmgate.runtime.engines import frontends
from slurmgate.runtime.engines.mocker import EtcdDiscovery, frontend_launch, mocker_launch
from slurmgate.runtime.engines.roles import LANE_DIR
from slurmgate.runtime.run.service_certs import make_service_pems
from slurmgate.runtime.steps import lane_launcher
from slurmgate.runtime.steps.node_worker import LaneSpec, NodeSpec, WorkerSpec
from slurmgate.testbed.localproc import free_port, free_port_below, stop_group

from .conftest import assert_no_orphans

REPO = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
HOST = "127.0.0.1"  # Dynamo's own listeners
ADDRESS = "127.0.0.2"  # etcd's and NATS's, as the client node's address
NODE = "sg-node"
MODEL = "tiny"
UP_WITHIN = 90.0  # a few seconds on two cores; the bound only keeps a broken start from hanging

pytestmark = [
    pytest.mark.skipif(
        not DYNAMO_PYTHON.exists(),
        reason="Dynamo is not installed: SLURMGATE_WITH_DYNAMO=1 scripts/setup.sh makes "
        ".venv-dynamo (scripts/test.sh does)",
    ),
    pytest.mark.skipif(
        shutil.which("etcd") is None,
        reason="etcd is not installed (scripts/setup.sh installs Debian's etcd-server)",
    ),
    pytest.mark.skipif(
        shutil.which("nats-server") is None,
        reason="nats-server is not installed (scripts/setup.sh installs it)",
    ),
]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in reversed(started):
        stop_group(proc, timeout=10)


def _start_service(
    name: str, ports: dict[str, int], pems: Any, root: Path
) -> subprocess.Popen[bytes]:
    """etcd or NATS as the services step starts it: TLS on ADDRESS, health on loopback."""
    where = root / name
    where.mkdir(mode=0o700)
    for file, text in frontends.service_files(name, ADDRESS, ports, pems).items():
        fd = os.open(where / file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    command = ["etcd"] if name == "etcd" else ["nats-server"]
    argv = frontends.service_argv(name, command, ADDRESS, ports, tls=True)
    with (root / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            [a.replace(LANE_DIR, str(where)) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait(what: str, check: Any, alive: list[subprocess.Popen[bytes]], logs: Path) -> Any:
    deadline = time.monotonic() + UP_WITHIN
    while True:
        for proc in alive:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args!r} exited {proc.returncode}\n{_logs(logs)}")
        try:
            if found := check():
                return found
        except (OSError, httpx.HTTPError, ssl.SSLError, http.client.HTTPException):
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not within {UP_WITHIN} s\n{_logs(logs)}")
        time.sleep(0.2)


def _logs(root: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(root.glob("*.log"))
    )


def _etcd_entries(port: int, client: Path) -> dict[str, str]:
    """Every key in etcd with its value, read over TLS with the run's client certificate."""
    ctx = ssl.create_default_context(cafile=str(client / frontends.CA_FILE))
    ctx.load_cert_chain(client / frontends.CLIENT_CERT_FILE, client / frontends.CLIENT_KEY_FILE)
    conn = http.client.HTTPSConnection(ADDRESS, port, context=ctx, timeout=5)
    try:
        everything = base64.b64encode(b"\0").decode()
        conn.request(
            "POST", "/v3/kv/range", json.dumps({"key": everything, "range_end": everything})
        )
        answer = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
        for kv in answer.get("kvs", [])
    }


def _session(leader: int) -> list[int]:
    """Every process of the session `leader` started (a lane and whatever it started)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2 :].split()[3]) == leader:
            found.append(int(entry.name))
    return found


def test_dynamo_reaches_etcd_over_tls_and_no_process_was_execd_with_the_key(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    token = f"sg-etcd-key-{uuid.uuid4().hex[:12]}"
    names = ("etcd", "etcd_peer", "nats", "nats_monitor", "http", "response", "rpc")
    ports = {name: free_port() for name in names}
    system = free_port_below(32767, HOST)
    pems = make_service_pems(token, [ADDRESS])
    secrets = [pems.client_key, pems.client_cert, pems.ca_cert, pems.server_key]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs.append(_start_service("etcd", ports, pems, logs))
    procs.append(_start_service("nats", ports, pems, logs))
    _wait(
        "etcd and NATS",
        lambda: (
            httpx.get(f"http://{HOST}:{ports['etcd']}/health", timeout=2).json()["health"] == "true"
            and httpx.get(f"http://{HOST}:{ports['nats_monitor']}/healthz", timeout=2).is_success
        ),
        procs,
        logs,
    )
    model = tmp_path / MODEL
    subprocess.run(
        [str(DYNAMO_PYTHON), "-m", "slurmgate.testbed.tiny_hf", str(model)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        capture_output=True,
        timeout=60,
    )

    # The lanes as the run gives them across hosts: the services' URLs, the paths of the
    # client certificate's files, ETCD_AUTH_* named as files only.
    discovery = EtcdDiscovery((f"https://{ADDRESS}:{ports['etcd']}",))
    services = frontends.frontend_env("dynamo", ADDRESS, ports, "tcp", tls=True)
    auth = {**services, **frontends.client_auth_env()}
    mocker = mocker_launch(
        "agg", str(model), MODEL, system, HOST, discovery, python=str(DYNAMO_PYTHON),
        rpc_port=ports["rpc"],
    )  # fmt: skip
    frontend = frontend_launch(
        ports["http"], HOST, discovery, python=str(DYNAMO_PYTHON), response_port=ports["response"]
    )
    # The lanes run without slurmgate on their path: the launcher stands alone.
    own = {"PYTHONPATH": "", "HOME": str(tmp_path)}
    lanes = [
        LaneSpec(
            id=f"dyn-{name}",
            argv=list(launch.argv),
            gpus=[],
            delay_s=0.0,
            env={**launch.env, **auth, **own},
            env_files=frontends.client_auth_env_files(),
        )
        for name, launch in (("mocker", mocker), ("frontend", frontend))
    ]
    spec = WorkerSpec(
        run_id=token,
        name="dyn",
        gpus_per_node=0,
        model_path=None,
        grace_s=5.0,
        nodes=[
            NodeSpec(
                host=NODE,
                ports=sorted([ports["http"], ports["response"], ports["rpc"], system]),
                lanes=lanes,
                address=HOST,
            )
        ],
        shared_files=pems.client_files(),
    )
    encoded = spec.encode()
    assert not any(s.splitlines()[1] in json.dumps(spec.to_json()) for s in [pems.server_key])
    step_log = logs / "01-dyn.log"
    worker_env = {
        **os.environ,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURMD_NODENAME": NODE,
        "CUDA_VISIBLE_DEVICES": "",
        "SLURMGATE_RUN_ID": token,
    }
    with step_log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "slurmgate.runtime.steps.node_worker", "serve", "--spec", "-"],
            env=worker_env,
            cwd=tmp_path,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    procs.append(worker)
    assert worker.stdin is not None
    worker.stdin.write(encoded.encode())
    worker.stdin.close()

    # (a) the mocker registered in etcd over TLS, the frontend found it there and serves it
    api = httpx.Client(base_url=f"http://{HOST}:{ports['http']}", timeout=30)
    _wait(
        "the model in the frontend's /v1/models",
        lambda: MODEL in [m["id"] for m in api.get("/v1/models").json()["data"]],
        procs,
        logs,
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "kabo"}], "max_tokens": 4}
    reply = api.post("/v1/chat/completions", json=chat)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    client = tmp_path / "client"
    client.mkdir(mode=0o700)
    for file, text in pems.client_files().items():
        (client / file).write_text(text)
    entries = _etcd_entries(ports["etcd"], client)
    assert any(k.startswith("v1/instances/") for k in entries), sorted(entries)

    # (b), (c): no process of either lane was exec'd with the text, nor holds it in argv
    started = dict(re.findall(r"started lane (\S+) pid (\d+)", step_log.read_text()))
    assert set(started) == {"dyn-mocker", "dyn-frontend"}, step_log.read_text()
    for lane, pid in started.items():
        module = "dynamo.mocker" if lane == "dyn-mocker" else "dynamo.frontend"
        members = _session(int(pid))
        assert int(pid) in members
        for member in members:
            environ = Path(f"/proc/{member}/environ").read_bytes().decode(errors="replace")
            cmdline = Path(f"/proc/{member}/cmdline").read_bytes().decode(errors="replace")
            if member == int(pid):
                assert f"ETCD_ENDPOINTS=https://{ADDRESS}:{ports['etcd']}" in environ.split("\0")
                assert f"{lane_launcher.FILE_NAME}\0" in cmdline
                assert f"\0-m\0{module}\0" in cmdline, cmdline
            assert "ETCD_AUTH_" not in environ, (lane, member)
            for text in (environ, cmdline):
                assert "BEGIN" not in text, (lane, member)
                for secret in secrets:
                    assert secret.splitlines()[1] not in text, (lane, member)
    # nor did Dynamo write it into discovery
    for value in entries.values():
        assert "BEGIN" not in value

    # a graceful stop, then nothing of the run is left, and the step's log holds no key
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.wait(timeout=30) == 128 + signal.SIGTERM, _logs(logs)
    assert_no_orphans(token, within=10)
    log = step_log.read_text(errors="replace")
    assert "started lane dyn-frontend" in log
    assert "BEGIN" not in log
    for secret in secrets:
        assert secret.splitlines()[1] not in log
