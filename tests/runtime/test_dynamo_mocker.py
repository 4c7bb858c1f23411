"""Dynamo's real frontend with a prefill and a decode mocker, on loopback, without Slurm.

The processes run from the `.venv-dynamo` venv (ai-dynamo 1.6.1, which scripts/setup.sh makes
when SLURMGATE_WITH_DYNAMO=1, as scripts/test.sh asks), launched as
`slurmgate.runtime.engines.mocker` renders them, on the tiny model directory of
`slurmgate.testbed.tiny_hf`. Once with file discovery, once with etcd (Debian's `etcd` on a free
loopback port, its data in the test's directory). The event plane runs in ZMQ broker mode
through `slurmgate.testbed.zmq_broker`, so that every listener of every process is on
127.0.0.1. Then a stream moving to another decode worker when its own is killed
(`--migration-limit`), and the listeners ZMQ's direct mode opens on 0.0.0.0 instead.
docs/dynamo-mocker.md has what was measured.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmgate.runtime.engines.mocker import (
    SYSTEM_PORT_MAX,
    Discovery,
    EtcdDiscovery,
    FileDiscovery,
    Launch,
    ZmqBroker,
    frontend_launch,
    mocker_launch,
)
from slurmgate.testbed.localproc import free_port, free_port_below, stop_group
from slurmgate.testbed.tiny_hf import SPECIAL_TOKENS, words

from .conftest import assert_no_orphans

REPO = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
HOST = "127.0.0.1"
MODEL = "tiny"
UP_WITHIN = 60.0  # about 4 s on two cores; the bound only keeps a broken start from hanging

pytestmark = pytest.mark.skipif(
    not DYNAMO_PYTHON.exists(),
    reason="Dynamo is not installed: SLURMGATE_WITH_DYNAMO=1 scripts/setup.sh makes .venv-dynamo"
    " (scripts/test.sh does)",
)


def system_port() -> int:
    """A free loopback port for a worker's system server (Dynamo reads it as an i16)."""
    return free_port_below(SYSTEM_PORT_MAX, HOST)


def write_tiny_model(python: Path, where: Path) -> Path:
    """The tiny model directory (config and tokenizer), written with `python`'s `tokenizers`."""
    subprocess.run(
        [str(python), "-m", "slurmgate.testbed.tiny_hf", str(where)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        capture_output=True,
        timeout=120,
    )
    return where


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(DYNAMO_PYTHON, tmp_path_factory.mktemp("model") / MODEL)


@dataclass
class Stack:
    """The processes a test started, by name, with the token every one of them carries."""

    root: Path
    token: str = field(default_factory=lambda: f"sg-dynamo-{uuid.uuid4().hex[:12]}")
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: tuple[str, ...] | list[str], env: Mapping[str, str]) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            list(argv),
            cwd=REPO,
            # HOME: the frontend caches the model files it fetches under ~/.cache/dynamo
            env={**os.environ, "HOME": str(self.root), "SLURMGATE_TEST_TOKEN": self.token, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def launch(self, name: str, launch: Launch) -> None:
        self.start(name, launch.argv, launch.env)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop_all(self) -> None:
        for proc in reversed(self.procs.values()):
            stop_group(proc, timeout=10)


@contextlib.contextmanager
def stack(root: Path) -> Iterator[Stack]:
    s = Stack(root)
    try:
        yield s
    finally:
        s.stop_all()
        assert_no_orphans(s.token, within=10)


def wait_for(what: str, check: Any, s: Stack, within: float = UP_WITHIN) -> Any:
    deadline = time.monotonic() + within
    while True:
        for name, proc in s.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}):\n{s.log(name)}")
        with contextlib.suppress(httpx.HTTPError):
            if found := check():
                return found
        if time.monotonic() >= deadline:
            logs = "\n".join(f"--- {n}\n{s.log(n)}" for n in s.procs)
            raise AssertionError(f"{what} not within {within} s\n{logs}")
        time.sleep(0.1)


def listeners(pids: Mapping[str, int]) -> dict[str, set[tuple[str, int]]]:
    """Every TCP and UDP socket listening in each process group, as (address, port)."""
    by_group: dict[str, set[tuple[str, int]]] = {name: set() for name in pids}
    groups = {pid: name for name, pid in pids.items()}
    for flags in ("-Hltnp", "-Hlunp"):
        out = subprocess.run(["ss", flags], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            fields = line.split()
            local = fields[3]
            address, _, port = local.rpartition(":")
            for pid in re.findall(r"pid=(\d+)", line):
                name = groups.get(process_group(int(pid)))
                if name is not None:
                    by_group[name].add((address.strip("[]"), int(port)))
    return by_group


def process_group(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rfind(")") + 2 :].split()[2])


def worker_requests(port: int, component: str) -> float:
    """The worker's own count of requests its `generate` endpoint served."""
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "dynamo_component_requests_total"
                and labels.get("dynamo_component") == component
                and labels.get("dynamo_endpoint") == "generate"
            ):
                total += sample.value
    return total


def frontend_successes(port: int) -> float:
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dynamo_frontend_requests_total"
        and sample.labels.get("status") == "success"
    )


VOCABULARY = set(words())


def assert_words(text: str) -> None:
    """The text is the tiny vocabulary's words: the mocker's token ids, detokenized."""
    found = text.split()
    assert found, f"no text in {text!r}"
    assert set(found) <= VOCABULARY | set(SPECIAL_TOKENS), text


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def discovery_entries(discovery: Discovery) -> list[dict[str, Any]]:
    """Every record in discovery, as JSON: the files under the directory, or etcd's keys."""
    if isinstance(discovery, FileDiscovery):
        root = Path(discovery.root)
        return [json.loads(p.read_text()) for p in sorted(root.rglob("*")) if p.is_file()]
    body = {
        "key": base64.b64encode(b"\0").decode(),
        "range_end": base64.b64encode(b"\0").decode(),  # with key "\0": every key
    }
    answer = httpx.post(f"{discovery.endpoints[0]}/v3/kv/range", json=body, timeout=5).json()
    return [json.loads(base64.b64decode(kv["value"])) for kv in answer.get("kvs", [])]


def component_of(entry: dict[str, Any]) -> str | None:
    scope = entry.get("scope") or {}
    return entry.get("component") or (scope.get("endpoint") or {}).get("component")


@contextlib.contextmanager
def discovery_service(kind: str, root: Path, s: Stack) -> Iterator[Discovery]:
    if kind == "file":
        yield FileDiscovery(str(root / "kv"))
        return
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (scripts/setup.sh installs Debian's etcd-server)")
    client, peer = f"http://{HOST}:{free_port()}", f"http://{HOST}:{free_port()}"
    s.start(
        "etcd",
        [
            "etcd",
            "--name",
            "sg",
            "--data-dir",
            str(root / "etcd"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"sg={peer}",
        ],
        {},
    )
    wait_for("etcd", lambda: httpx.get(f"{client}/health", timeout=2).json()["health"], s)
    yield EtcdDiscovery((client,))


@dataclass
class Serving:
    """A frontend over mocker workers (by name: their role, system and request-plane ports),
    all in broker mode, and the broker."""

    api: httpx.Client
    ports: dict[str, int]
    workers: dict[str, tuple[str, dict[str, int]]]


def serve(
    s: Stack,
    discovery: Discovery,
    model_dir: Path,
    roles: dict[str, str],
    *,
    migration_limit: int | None = None,
) -> Serving:
    """Start the broker, a mocker per entry of `roles` (name: role) and the frontend, and wait
    until the model is listed and every worker's /health answers 200."""
    python = str(DYNAMO_PYTHON)
    ports = {name: free_port() for name in ("http", "response", "broker_xsub", "broker_xpub")}
    workers = {
        name: (role, {"system": system_port(), "rpc": free_port()}) for name, role in roles.items()
    }
    broker = ZmqBroker(
        f"tcp://{HOST}:{ports['broker_xsub']}", f"tcp://{HOST}:{ports['broker_xpub']}"
    )
    s.start(
        "broker",
        [python, "-m", "slurmgate.testbed.zmq_broker", broker.xsub, broker.xpub],
        {"PYTHONPATH": str(REPO)},
    )
    for name, (role, p) in workers.items():
        s.launch(
            name,
            mocker_launch(
                role,  # type: ignore[arg-type]
                str(model_dir),
                MODEL,
                p["system"],
                HOST,
                discovery,
                python=python,
                rpc_port=p["rpc"],
                broker=broker,
            ),
        )
    s.launch(
        "frontend",
        frontend_launch(
            ports["http"],
            HOST,
            discovery,
            python=python,
            response_port=ports["response"],
            migration_limit=migration_limit,
            broker=broker,
        ),
    )
    api = httpx.Client(base_url=f"http://{HOST}:{ports['http']}", timeout=30)

    def model_listed() -> bool:
        return MODEL in [m["id"] for m in api.get("/v1/models").json()["data"]]

    wait_for("the model in the frontend's /v1/models", model_listed, s)
    for name, (_, p) in workers.items():
        health = f"http://{HOST}:{p['system']}/health"
        wait_for(f"{name}'s /health", lambda u=health: httpx.get(u).status_code == 200, s)
    return Serving(api, ports, workers)


@pytest.mark.parametrize("backend", ["file", "etcd"])
def test_frontend_prefill_and_decode_serve_on_loopback(
    backend: str, model_dir: Path, tmp_path: Path
) -> None:
    with stack(tmp_path) as s, discovery_service(backend, tmp_path, s) as discovery:
        serving = serve(s, discovery, model_dir, {"prefill": "prefill", "decode": "decode"})
        api, ports = serving.api, serving.ports
        workers = {name: p for name, (_, p) in serving.workers.items()}
        before = {
            role: worker_requests(p["system"], component(role)) for role, p in workers.items()
        }

        # plain and streamed chat, and a plain completion
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "kabo lade"}]}
        reply = api.post("/v1/chat/completions", json={**chat, "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        assert_words(reply.json()["choices"][0]["message"]["content"])
        with api.stream(
            "POST", "/v1/chat/completions", json={**chat, "max_tokens": 8, "stream": True}
        ) as streamed:
            assert streamed.status_code == 200
            events = list(sse_events(streamed.iter_lines()))
        assert events[-1] == "[DONE]"
        deltas = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
        assert_words("".join(d for d in deltas if d))
        completion = api.post(
            "/v1/completions", json={"model": MODEL, "prompt": "kabo", "max_tokens": 4}
        )
        assert completion.status_code == 200, completion.text
        assert_words(completion.json()["choices"][0]["text"])

        # each worker counted the three requests it served, and the frontend their success
        for role, p in workers.items():
            assert worker_requests(p["system"], component(role)) == before[role] + 3, role
        assert frontend_successes(ports["http"]) == 3

        # every listener of every process is on loopback, and these are all of them
        found = listeners({name: proc.pid for name, proc in s.procs.items()})
        assert found["frontend"] == {(HOST, ports["http"]), (HOST, ports["response"])}
        for role, p in workers.items():
            assert found[role] == {(HOST, p["system"]), (HOST, p["rpc"])}, role
        assert found["broker"] == {(HOST, ports["broker_xsub"]), (HOST, ports["broker_xpub"])}
        assert all(address == HOST for sockets in found.values() for address, _ in sockets), found

        # a decode worker killed mid-stream ends the client's stream with an error event
        killed_at = stream_through_kill(api, chat, s.procs["decode"])
        assert killed_at < 15.0, f"the stream ended {killed_at:.1f} s after the kill"
        started = time.monotonic()
        after = api.post("/v1/chat/completions", json={**chat, "max_tokens": 4})
        assert after.status_code in (404, 503), after.text
        assert time.monotonic() - started < 10

        # a graceful stop removes a process's discovery entries; only the killed decode's may
        # stay, until their lease ends (about 13 s with files, 30 s with etcd)
        assert "prefill" in {component_of(e) for e in discovery_entries(discovery)}
        for name in ("frontend", "prefill"):
            stop_group(s.procs[name], timeout=10)
        left = {component_of(e) for e in discovery_entries(discovery)}
        assert left <= {"backend"}, left  # the decode worker's component
    if isinstance(discovery, FileDiscovery):
        shutil.rmtree(discovery.root)
    shutil.rmtree(tmp_path / ".cache", ignore_errors=True)


def test_a_stream_moves_to_another_decode_worker_when_its_own_is_killed(
    model_dir: Path, tmp_path: Path
) -> None:
    """With --migration-limit, the frontend carries a stream whose decode worker dies over to
    the other decode worker: the client sees one whole answer, no error."""
    roles = {"prefill": "prefill", "decode-a": "decode", "decode-b": "decode"}
    with stack(tmp_path) as s:
        discovery = FileDiscovery(str(tmp_path / "kv"))
        serving = serve(s, discovery, model_dir, roles, migration_limit=2)
        decodes = {n: p["system"] for n, (role, p) in serving.workers.items() if role == "decode"}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "kabo"}]}
        body = {**chat, "max_tokens": 300, "stream": True}
        events: list[dict[str, Any]] = []
        victim = ""
        with serving.api.stream("POST", "/v1/chat/completions", json=body) as streamed:
            assert streamed.status_code == 200
            for event in sse_events(streamed.iter_lines()):
                if event == "[DONE]":
                    break
                events.append(json.loads(event))
                if len(events) == 5:
                    busy = [n for n, port in decodes.items() if worker_inflight(port) > 0]
                    assert len(busy) == 1, busy
                    victim = busy[0]
                    os.kill(s.procs[victim].pid, signal.SIGKILL)
        assert victim
        assert not [e for e in events if "error" in e], [e for e in events if "error" in e]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert len(text.split()) == 300
        assert_words(text)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        (survivor,) = set(decodes) - {victim}
        assert worker_requests(decodes[survivor], "backend") == 1


def worker_inflight(port: int) -> float:
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dynamo_component_inflight_requests"
        and sample.labels.get("dynamo_endpoint") == "generate"
    )


def component(role: str) -> str:
    """The Dynamo component a mocker of `role` registers (its endpoint default)."""
    return "prefill" if role == "prefill" else "backend"


def stream_through_kill(
    api: httpx.Client, chat: dict[str, Any], decode: subprocess.Popen[bytes]
) -> float:
    """Stream a long answer, SIGKILL the decode worker at its first token, and return how long
    after the kill the stream ended; it must end with an error event, then [DONE]."""
    killed: list[float] = []
    events: list[str] = []
    body = {**chat, "max_tokens": 4000, "stream": True}
    watchdog = threading.Timer(30, api.close)  # a hang fails the test instead of blocking it
    watchdog.start()
    try:
        with api.stream("POST", "/v1/chat/completions", json=body) as streamed:
            assert streamed.status_code == 200
            for event in sse_events(streamed.iter_lines()):
                events.append(event)
                if not killed:
                    os.kill(decode.pid, signal.SIGKILL)
                    killed.append(time.monotonic())
    finally:
        watchdog.cancel()
    ended = time.monotonic() - killed[0]
    assert events[-1] == "[DONE]", events[-3:]
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    assert errors and errors[0]["code"] == 503, events[-3:]
    assert len(events) < 1000, "the stream ran on after its worker was killed"
    return ended


def test_direct_zmq_publishers_listen_on_every_interface(model_dir: Path, tmp_path: Path) -> None:
    """Without a broker, a mocker's event-plane publishers bind 0.0.0.0: exactly the ports it
    advertises in discovery (at DYN_EVENT_PLANE_HOST), while its other listeners stay on the
    bind host. No Dynamo 1.6.1 variable moves that bind; broker mode removes the sockets."""
    system, rpc = system_port(), free_port()
    discovery = FileDiscovery(str(tmp_path / "kv"))
    with stack(tmp_path) as s:
        launch = mocker_launch(
            "decode",
            str(model_dir),
            MODEL,
            system,
            HOST,
            discovery,
            python=str(DYNAMO_PYTHON),
            rpc_port=rpc,
        )
        s.launch("decode", launch)
        health = f"http://{HOST}:{system}/health"
        wait_for("the decode mocker's /health", lambda: httpx.get(health).status_code == 200, s)

        def advertised() -> set[int]:
            return {
                int(e["transport"]["config"]["endpoint"].rpartition(":")[2])
                for e in discovery_entries(discovery)
                if e.get("type") == "EventChannel"
            }

        ports = wait_for(
            "the publishers in discovery", lambda: len(advertised()) == 3 and advertised(), s
        )
        found = listeners({"decode": s.procs["decode"].pid})["decode"]
        assert {port for address, port in found if address == "0.0.0.0"} == ports
        assert {(a, p) for a, p in found if a != "0.0.0.0"} == {(HOST, system), (HOST, rpc)}
        entries = discovery_entries(discovery)
        assert {e["topic"] for e in entries if e.get("type") == "EventChannel"} == {
            "active_sequences_events",
            "forward-pass-metrics",
            "kv_metrics",
        }
        for e in entries:
            if e.get("type") == "EventChannel":
                assert e["transport"]["config"]["endpoint"].startswith(f"tcp://{HOST}:")
