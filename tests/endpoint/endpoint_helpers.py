"""Helpers for the endpoint tests: real loopback servers (in-process ASGI, stub subprocesses)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from slurmgate.runtime.endpoint.app import EndpointServer
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.testbed.localproc import free_port

REPO = Path(__file__).resolve().parents[2]
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def refused_url() -> str:
    """A loopback URL where nothing listens: connecting to it fails at once."""
    return f"http://127.0.0.1:{free_port()}"


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_asgi(app: ASGIApp, *, lifespan: str = "off", **options: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port in this event loop; ``options``
    go to uvicorn.Config (``http="h11"`` picks the other HTTP parser)."""
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then (else Nagle
    # plus delayed ACK add 40 ms to every response under the default event loop).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan=lifespan,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
        **options,
    )
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 5
    while not server.started:
        if task.done():
            task.result()
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        sock.close()


@dataclass
class Backend:
    """A scripted backend: answers with a fixed status/headers, records what it received."""

    name: str
    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    delay: float = 0.0
    hang: bool = False
    metrics: str | None = None  # None → 404 on /metrics
    metrics_status: int = 200
    metrics_hang: bool = False  # /metrics reads the request and never answers
    metrics_chunk: int = 0  # > 0: /metrics streams in chunks of this size, no Content-Length
    health_status: int = 200
    hits: int = 0
    seen_headers: list[dict[str, str]] = field(default_factory=list)
    seen_bodies: list[bytes] = field(default_factory=list)
    client_ports: set[int] = field(default_factory=set)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/metrics":
            if self.metrics_hang:
                # until the scraper gives up and closes the connection
                while (await receive())["type"] != "http.disconnect":
                    pass
            elif self.metrics is None:
                await _send(send, 404, b"not found")
            elif self.metrics_chunk:
                await _send_chunked(send, self.metrics.encode(), self.metrics_chunk)
            else:
                await _send(send, self.metrics_status, self.metrics.encode(), b"text/plain")
            return
        if path == "/health":
            await _send(send, self.health_status, b"ok")
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.hits += 1
        self.client_ports.add(scope["client"][1])
        self.seen_headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        self.seen_bodies.append(body)
        if self.hang:
            await asyncio.Event().wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        payload = f'{{"backend": "{self.name}", "status": {self.status}}}'.encode()
        await _send(send, self.status, payload, b"application/json", self.headers)


async def _send(
    send: Any,
    status: int,
    body: bytes,
    content_type: bytes = b"text/plain",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


async def _send_chunked(send: Any, body: bytes, size: int) -> None:
    headers = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for start in range(0, len(body), size):
        chunk = body[start : start + size]
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


# Queue sampling fast enough that a test sees a verdict change within a few tenths of a second.
FAST: dict[str, float] = {"sample_interval": 0.05, "metrics_timeout": 0.2, "stale_after": 0.5}


def waiting_metrics(depth: float, model: str = "m") -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{model}"}} {depth}\n'
    )


@contextlib.asynccontextmanager
async def running_backends(*apps: ASGIApp) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_asgi(app)) for app in apps]


@contextlib.asynccontextmanager
async def running_endpoint(backends: list[str], **settings: Any) -> AsyncIterator[tuple[str, Any]]:
    """The real endpoint on a free loopback port in this event loop; yields its URL and its
    Endpoint object."""
    config = EndpointConfig(name="test", backends=backends, **settings)
    server = EndpointServer(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    await server.start(sock)
    try:
        yield f"http://127.0.0.1:{server.port}", server.endpoint
    finally:
        await server.stop()
        sock.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


def python_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGATE_STUB_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    url: str
    port: int

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stderr(self) -> str:
        assert self.popen.stderr is not None
        return self.popen.stderr.read().decode(errors="replace")


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """Start ``python -m <module> args``; every process still alive at teardown is killed."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(module: str, *args: str, env: dict[str, str] | None = None, port: int = 0) -> Proc:
        full_env = python_env()
        full_env.update(env or {})
        popen = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        procs.append(popen)
        return Proc(popen, f"http://127.0.0.1:{port}", port)

    yield start
    for popen in procs:
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(5)
        if popen.stderr is not None:
            popen.stderr.close()


@pytest.fixture
def stub(spawn: Callable[..., Proc]) -> Callable[..., Proc]:
    """Start a stub model server on a free port (not waiting for readiness)."""

    def start(*args: str, env: dict[str, str] | None = None) -> Proc:
        port = free_port()
        return spawn(
            "slurmgate.testbed.stub_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
            env=env,
            port=port,
        )

    return start


async def wait_status(
    client: httpx.AsyncClient, url: str, status: int, timeout: float = 5.0
) -> float:
    """Poll url until it answers status; returns the seconds waited."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(url, timeout=1)).status_code == status:
                return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{url} did not answer {status} within {timeout}s")
        await asyncio.sleep(0.03)


async def until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def endpoint_process(
    backend: str,
    *flags: str,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """`python -m slurmgate.runtime.endpoint` in front of backend, once its /health answers."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "slurmgate.runtime.endpoint", "--name", "big"),
            *("--listen", f"127.0.0.1:{port}", "--backend", backend, *flags),
        ],
        env={**python_env(), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=preexec_fn,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{url}/health", timeout=1)).status_code == 200:
                        break
                assert proc.poll() is None and time.monotonic() < deadline, "endpoint not up"
                await asyncio.sleep(0.05)
        yield url, proc
    finally:
        proc.kill()
        proc.wait(5)


def proc_status_mib(pid: int, field: str) -> float:
    """A memory line of /proc/PID/status (VmRSS, VmHWM), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def peak_rss_mib(pid: int) -> float:
    return proc_status_mib(pid, "VmHWM")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, ppid, ...), if any."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether a process runs: it exists and is not a zombie waiting to be reaped."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (a scan of /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def parser_of(endpoint: int) -> int:
    """The pid of a PD endpoint's body-parser process (its one child, ``pdparser.py``)."""
    deadline = time.monotonic() + 10
    while not (kids := children_of(endpoint)):
        assert time.monotonic() < deadline, "the endpoint has no parser process"
        time.sleep(0.02)
    assert len(kids) == 1, kids
    return kids[0]
