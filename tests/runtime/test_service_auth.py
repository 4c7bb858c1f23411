"""Dynamo's etcd and NATS are the run's own: loopback on one host, mutual TLS across hosts.

A deployment whose every lane runs on the client host gets etcd and NATS on 127.0.0.1 and no
certificates. One with workers on other nodes gets them on the client node's address, asking
every client for a certificate of the run's own CA: the CA, the servers' and the lanes' keys
travel as files of the lanes' private directories (0600), never in argv, the environment a
process is started with, the run's record or its artifacts. The real nats-server and etcd
(scripts/setup.sh installs both) refuse a client without the certificate and serve one with
it. No Slurm.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.engines import frontends, layout, service_lanes
from slurmgate.runtime.engines.roles import LANE_DIR
from slurmgate.runtime.ledger.records import RECORD_NAME
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.service_certs import deployment_pems, make_service_pems
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.steps import lane_launcher
from slurmgate.runtime.steps.node_worker import Lanes, LaneSpec, WorkerSpec, WorkerSpecError

DYNAMO = ["python3", "-m", "dynamo.sglang", "--model-path", "/model"]
SECRET_FILES = (frontends.SERVER_KEY_FILE, frontends.CLIENT_KEY_FILE)


def _spec(roles: dict[str, Any]) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "name": "a",
            "client": {"command": ["true"]},
            "gpus_per_node": 8,
            "deployments": [
                {
                    "name": "dyn",
                    "engine": "dynamo-sglang",
                    "command": DYNAMO,
                    "roles": roles,
                    "frontend": {"type": "dynamo"},
                }
            ],
        }
    )


def _run(roles: dict[str, Any], tmp_path: Path) -> AllocationRun:
    run = AllocationRun(_spec(roles), runs_root=tmp_path)
    hosts = [f"n{i}" for i in range(run.plan.total_nodes)]
    run.layout = layout.bind(run.plan, hosts, {h: f"10.0.0.{i + 1}" for i, h in enumerate(hosts)})
    return run


def _launches(run: AllocationRun) -> list[service_lanes.ServiceLaunch]:
    """The service lanes as `services.start_services` renders them."""
    assert run.layout
    (d,) = run.plan.deployments
    pems = deployment_pems(run.context, d)
    return service_lanes.service_launches(run.spec.deployments[0], run.layout, d, pems)


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


ONE_HOST = {"agg": {"tensor_parallel": 2}}
TWO_HOSTS = {"prefill": {"tensor_parallel": 8}, "decode": {"tensor_parallel": 8}}


def test_on_one_host_etcd_and_nats_listen_on_loopback_without_certificates(
    tmp_path: Path,
) -> None:
    run = _run(ONE_HOST, tmp_path)
    assert run.layout and run.plan.total_nodes == 1
    etcd, nats, frontend = _launches(run)
    assert _value(etcd.argv, "--listen-client-urls") == "http://127.0.0.1:2379"
    assert _value(etcd.argv, "--listen-peer-urls") == "http://127.0.0.1:2380"
    assert "--client-cert-auth" not in etcd.argv and etcd.files == {}
    assert nats.files == {
        "nats.conf": 'host: "127.0.0.1"\nport: 4222\nhttp: "127.0.0.1:8222"\n',
    }
    assert "--tlsverify" not in nats.argv
    assert frontend.env["ETCD_ENDPOINTS"] == "http://127.0.0.1:2379"
    assert frontend.env["NATS_SERVER"] == "nats://127.0.0.1:4222"
    assert frontend.files == {} and "ETCD_AUTH_CA" not in frontend.env
    assert service_lanes.service_env(run.spec.deployments[0], run.layout)["ETCD_ENDPOINTS"] == (
        "http://127.0.0.1:2379"
    )
    (d,) = run.plan.deployments
    assert not run.context.service_pems
    for lane in (lane for n in run._worker_spec(d).nodes for lane in n.lanes):
        assert lane.files == {} and not any(k.startswith("ETCD_AUTH") for k in lane.env)


def test_nodes_that_share_loopback_share_the_services_on_it(tmp_path: Path) -> None:
    """Nodes addressed as 127.0.0.1 are one machine (a local test cluster): loopback serves."""
    run = AllocationRun(_spec(TWO_HOSTS), runs_root=tmp_path)
    run.layout = layout.bind(run.plan, ["n0", "n1"], {"n0": "127.0.0.1", "n1": "127.0.0.1"})
    etcd, _, frontend = _launches(run)
    assert _value(etcd.argv, "--listen-client-urls") == "http://127.0.0.1:2379"
    assert frontend.files == {} and not run.context.service_pems


def _artifacts(run: AllocationRun, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What the allocation flow publishes of the run as Prefect artifacts, by key, as text."""
    from slurmgate.tasks import allocation as artifacts

    published: dict[str, str] = {}

    def keep(**kw: Any) -> None:
        published[kw["key"]] = json.dumps(kw)

    monkeypatch.setattr(artifacts, "create_table_artifact", keep)
    monkeypatch.setattr(artifacts, "create_markdown_artifact", keep)
    artifacts.publish_layout(run)
    artifacts.publish_record(run)
    return published


def test_across_hosts_every_lane_gets_its_certificates_as_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(TWO_HOSTS, tmp_path)
    assert run.layout and run.plan.total_nodes == 2
    etcd, nats, frontend = _launches(run)
    pems = run.context.service_pems["dyn"]
    # etcd: TLS on the client node's address, client certificates required, /health on
    # loopback for the probe, the peer listener on loopback
    assert _value(etcd.argv, "--listen-client-urls") == "https://10.0.0.1:2379"
    assert "--client-cert-auth" in etcd.argv
    assert _value(etcd.argv, "--trusted-ca-file") == f"{LANE_DIR}/service-ca.pem"
    assert _value(etcd.argv, "--listen-metrics-urls") == "http://127.0.0.1:2379"
    assert _value(etcd.argv, "--listen-peer-urls") == "http://127.0.0.1:2380"
    assert etcd.files == pems.server_files()
    # NATS: its config file, and every client verified against the run's CA
    assert nats.files["nats.conf"] == 'host: "10.0.0.1"\nport: 4222\nhttp: "127.0.0.1:8222"\n'
    assert _value(nats.argv, "--tlscacert") == f"{LANE_DIR}/service-ca.pem"
    assert "--tlsverify" in nats.argv
    # the frontend and every worker: URLs in the step's env, paths of their own files
    step_env = service_lanes.service_env(run.spec.deployments[0], run.layout)
    assert step_env["ETCD_ENDPOINTS"] == "https://10.0.0.1:2379"
    assert step_env["NATS_SERVER"] == "tls://10.0.0.1:4222"
    auth = frontends.client_auth_env()
    assert {k: frontend.env[k] for k in [*step_env, *auth]} == {**step_env, **auth}
    assert frontend.files == pems.client_files()
    assert frontend.env_files == frontends.client_auth_env_files()
    assert auth["NATS_TLS_CLIENT_KEY_PATH"] == f"{LANE_DIR}/service-client.key"
    (d,) = run.plan.deployments
    worker = run._worker_spec(d)
    lanes = [lane for n in worker.nodes for lane in n.lanes]
    assert len({n.host for n in worker.nodes}) == 2
    assert worker.shared_files == pems.client_files()  # sent once, written for every lane
    for lane in lanes:
        assert lane.files == {}
        assert {k: lane.env[k] for k in auth} == auth
        assert lane.env_files == frontends.client_auth_env_files()
    decoded = WorkerSpec.decode(worker.encode())
    assert decoded.shared_files == pems.client_files()
    assert decoded.nodes[0].lanes[0].env_files == frontends.client_auth_env_files()
    # no key, certificate or CA text in any argv or env, nor in the record
    secrets = [pems.server_key, pems.client_key, pems.ca_cert, pems.client_cert]
    shown = json.dumps(
        {
            "argv": [s.argv for s in (etcd, nats, frontend)] + [lane.argv for lane in lanes],
            "env": [s.env for s in (etcd, nats, frontend)] + [lane.env for lane in lanes],
            "step_env": step_env,
        }
    )
    record = run.context.record().to_json()
    for secret in secrets:
        body = secret.splitlines()[1]  # a line of the base64 body
        assert body not in shown and body not in record
    # nor in what the run writes (its directory: the record) or publishes (its artifacts)
    run.save()
    written = {p.name: p.read_text() for p in run.run_dir.rglob("*") if p.is_file()}
    assert RECORD_NAME in written
    published = _artifacts(run, monkeypatch)
    assert run.run_id in published["allocation-record"]
    assert "dyn" in published["allocation-layout"]
    for secret in secrets:
        body = secret.splitlines()[1]
        for text in [*written.values(), *published.values()]:
            assert body not in text and "BEGIN" not in text
    # a new run makes a new CA
    other = _run(TWO_HOSTS, tmp_path / "other")
    _launches(other)
    assert other.context.service_pems["dyn"].ca_cert != pems.ca_cert


# A lane that writes what its process's getenv (C's, which Dynamo's Rust runtime reads) finds
# in ETCD_AUTH_*, then waits to be stopped.
GETENV_LANE = """
import ctypes, json, os, sys, time
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
found = {v: (getenv(v.encode()) or b"").decode() for v in sys.argv[2:]}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(found, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(30)
"""


def test_the_node_worker_writes_them_0600_and_sets_etcds_inside_the_lane_only(
    tmp_path: Path,
) -> None:
    """NATS's client reads the files by path; Dynamo's etcd client takes PEM text only, so the
    lane starts through the launcher, which sets ETCD_AUTH_* inside its process: exec's
    environment (/proc/PID/environ) and argv never hold the text."""
    pems = make_service_pems("r1", ["10.0.0.1"])
    seen = tmp_path / "seen.json"
    auth_files = frontends.client_auth_env_files()
    lane = LaneSpec(
        id="dyn-frontend",
        argv=[sys.executable, "-c", GETENV_LANE, str(seen), *auth_files],
        gpus=[],
        delay_s=0.0,
        env={"NATS_SERVER": "tls://10.0.0.1:4222", **frontends.client_auth_env()},
        files={"own.yaml": "{}"},
        env_files=auth_files,
    )
    lanes = Lanes(grace_s=1.0, shared_files=pems.client_files())
    try:
        lanes.spawn(lane, [], "r1")
        # the lane's private directory, then its TMPDIR
        where, scratch = lanes.dirs
        assert Path(scratch).name.startswith("sg-tmp-")
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
        for name in [*pems.client_files(), "own.yaml", lane_launcher.FILE_NAME]:
            assert stat.S_IMODE(os.stat(Path(where) / name).st_mode) == 0o600
        assert (Path(where) / "service-client.key").read_text() == pems.client_key
        (_, proc) = lanes.procs[0]
        env = _environ(proc.pid)
        assert env["NATS_TLS_CLIENT_KEY_PATH"] == f"{where}/service-client.key"
        assert env["NATS_TLS_CA_CERT_PATH"] == f"{where}/service-ca.pem"
        # the lane's process finds the text, as Dynamo's runtime reads it
        found = _wait_json(seen, proc)
        assert found == {
            "ETCD_AUTH_CA": pems.ca_cert,
            "ETCD_AUTH_CLIENT_CERT": pems.client_cert,
            "ETCD_AUTH_CLIENT_KEY": pems.client_key,
        }
        # but neither the environment it was exec'd with nor its argv holds any of it
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert not any(k.startswith("ETCD_AUTH") for k in env)
        for text in (Path(f"/proc/{proc.pid}/environ").read_bytes().decode(), cmdline):
            assert "BEGIN" not in text
            for pem in (pems.client_key, pems.client_cert, pems.ca_cert):
                assert pem.splitlines()[1] not in text
        assert f"ETCD_AUTH_CLIENT_KEY={where}/service-client.key" in cmdline.split("\0")
        # the spec the node worker was sent names the files only
        assert pems.client_key.splitlines()[1] not in json.dumps(lane.env | lane.env_files)
    finally:
        lanes.stop()
    assert not Path(where).exists()


def test_a_lane_that_is_not_a_python_program_cannot_take_them() -> None:
    """Only a Python program can set the variables inside its own process."""
    with pytest.raises(WorkerSpecError, match="start the command with the Python interpreter"):
        LaneSpec(
            id="dyn-frontend",
            argv=["dynamo-run", "in=http"],
            gpus=[],
            delay_s=0.0,
            env={},
            env_files=frontends.client_auth_env_files(),
        )


def _wait_json(path: Path, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + 10
    while not path.exists():
        assert proc.poll() is None, f"the lane exited {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _environ(pid: int) -> dict[str, str]:
    """A process's environment, once it has exec'd (the child's copy lands a moment late)."""
    deadline = time.monotonic() + 5
    while True:
        text = Path(f"/proc/{pid}/environ").read_text()
        env = dict(entry.split("=", 1) for entry in text.split("\0") if "=" in entry)
        if "SLURMGATE_RUN_LANE" in env or time.monotonic() > deadline:
            return env
        time.sleep(0.05)


# -- the real servers ---------------------------------------------------------------------------
# They listen on 127.0.0.2 (loopback too, on Linux) as on a node's address, so that their
# loopback health listeners on 127.0.0.1 may share the port number, as on a node.
ADDRESS = "127.0.0.2"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def lane_dir(tmp_path: Path) -> Path:
    where = tmp_path / "lane"
    where.mkdir(mode=0o700)
    return where


def _start(
    launch_argv: list[str], files: dict[str, str], where: Path, log: Path
) -> subprocess.Popen[bytes]:
    for name, text in files.items():
        fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    argv = [a.replace(LANE_DIR, str(where)) for a in launch_argv]
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def stop() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered: {log.read_text()}")


def _client_context(where: Path, *, with_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(where / frontends.CA_FILE))
    if with_cert:
        ctx.load_cert_chain(where / frontends.CLIENT_CERT_FILE, where / frontends.CLIENT_KEY_FILE)
    return ctx


def _nats_pong(port: int, ctx: ssl.SSLContext | None) -> str:
    """CONNECT and PING through NATS's TLS upgrade; what the server answers, or the error."""
    try:
        with socket.create_connection((ADDRESS, port), timeout=5) as raw:
            info = json.loads(raw.makefile("rb").readline().decode().removeprefix("INFO "))
            if ctx is None:
                raw.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
                return raw.recv(4096).decode()
            assert info["tls_required"] is True
            with ctx.wrap_socket(raw, server_hostname=ADDRESS) as tls:
                tls.sendall(b'CONNECT {"verbose":false,"tls_required":true}\r\nPING\r\n')
                return tls.recv(4096).decode()
    except (OSError, ssl.SSLError) as exc:
        return f"refused: {exc}"


@pytest.mark.skipif(shutil.which("nats-server") is None, reason="nats-server is not installed")
def test_a_real_nats_server_refuses_a_client_without_the_runs_certificate(
    lane_dir: Path, tmp_path: Path, stop: list[subprocess.Popen[bytes]]
) -> None:
    nats_port, monitor, etcd, peer = _free_ports(4)
    ports = {"nats": nats_port, "nats_monitor": monitor, "etcd": etcd, "etcd_peer": peer}
    pems = make_service_pems("r1", [ADDRESS])
    argv = frontends.service_argv("nats", ["nats-server"], ADDRESS, ports, tls=True)
    files = {**frontends.service_files("nats", ADDRESS, ports, pems), **pems.client_files()}
    log = tmp_path / "nats.log"
    proc = _start(argv, files, lane_dir, log)
    stop.append(proc)
    # its monitor answers on loopback only
    assert _wait_http(f"http://127.0.0.1:{monitor}/healthz", proc, log) == {"status": "ok"}
    with pytest.raises(OSError):
        socket.create_connection((ADDRESS, monitor), timeout=2).close()
    assert _nats_pong(nats_port, _client_context(lane_dir, with_cert=True)).startswith("PONG")
    assert not _nats_pong(nats_port, _client_context(lane_dir, with_cert=False)).startswith("PONG")
    assert not _nats_pong(nats_port, None).startswith("PONG")
    # a certificate of another run's CA does not open it either
    other = make_service_pems("r2", [ADDRESS])
    elsewhere = tmp_path / "other"
    elsewhere.mkdir(mode=0o700)
    for name, text in other.client_files().items():
        (elsewhere / name).write_text(text)
    foreign = ssl.create_default_context(cafile=str(lane_dir / frontends.CA_FILE))
    foreign.load_cert_chain(
        elsewhere / frontends.CLIENT_CERT_FILE, elsewhere / frontends.CLIENT_KEY_FILE
    )
    assert not _nats_pong(nats_port, foreign).startswith("PONG")


def _etcd_put(port: int, ctx: ssl.SSLContext) -> Any:
    conn = http.client.HTTPSConnection(ADDRESS, port, context=ctx, timeout=5)
    try:
        b64 = base64.b64encode(b"/services/outsider").decode()
        conn.request("POST", "/v3/kv/put", json.dumps({"key": b64, "value": b64}))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_a_real_etcd_refuses_a_client_without_the_runs_certificate(
    lane_dir: Path, tmp_path: Path, stop: list[subprocess.Popen[bytes]]
) -> None:
    etcd_port, peer, nats, monitor = _free_ports(4)
    ports = {"etcd": etcd_port, "etcd_peer": peer, "nats": nats, "nats_monitor": monitor}
    pems = make_service_pems("r1", [ADDRESS])
    argv = frontends.service_argv("etcd", ["etcd"], ADDRESS, ports, tls=True)
    files = {**frontends.service_files("etcd", ADDRESS, ports, pems), **pems.client_files()}
    files.pop(frontends.CA_FILE)  # the server's and the client's CA are one file
    files[frontends.CA_FILE] = pems.ca_cert
    log = tmp_path / "etcd.log"
    proc = _start(argv, files, lane_dir, log)
    stop.append(proc)
    # the readiness probe's /health answers on loopback, where the client listener is not
    assert _wait_http(f"http://127.0.0.1:{etcd_port}/health", proc, log)["health"] == "true"
    status, _ = _etcd_put(etcd_port, _client_context(lane_dir, with_cert=True))
    assert status == 200
    with pytest.raises((OSError, ssl.SSLError, http.client.HTTPException)):
        _etcd_put(etcd_port, _client_context(lane_dir, with_cert=False))
    # nor does plain HTTP on its address get an answer
    with pytest.raises((OSError, http.client.HTTPException)):
        conn = http.client.HTTPConnection(ADDRESS, etcd_port, timeout=5)
        conn.request("GET", "/v3/kv/range")
        assert conn.getresponse().status != 200
