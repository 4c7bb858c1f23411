"""The endpoint's bounds under a hostile client on raw sockets: memory, a neighbour's latency,
connections.

One endpoint process runs for the module, as on a compute node (`python -m
slurmgate.runtime.endpoint`), with a bearer token, in front of a stub lane, and with a file
limit of 256 so that running out of descriptors is cheap to reach. Every test attacks it with
raw bytes and holds it to the same bounds, stated here and in the README:

- MEMORY: its peak resident memory stays within ``MEMORY_MIB`` of what it was at the start;
- LATENCY: a ``GET /health`` on another connection, polled through the attack, always answers
  200 within ``LATENCY_S``;
- CONNECTIONS: it never holds more than ``MAX_CONNECTIONS`` client sockets (plus its lanes'
  pool and its own), and every connection it refused early is closed within ``CLOSE_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from endpoint_helpers import endpoint_process, peak_rss_mib, python_env, wait_status

from slurmgate.runtime.endpoint.config import TOKEN_ENV
from slurmgate.runtime.endpoint.dataplane import LINGER_S
from slurmgate.testbed.localproc import free_port

TOKEN = "bounds-endpoint-token"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"
MIB = 1024 * 1024
MEMORY_MIB = 48.0
LATENCY_S = 1.0
MAX_CONNECTIONS = 64
POOL = 8
BODY_TIMEOUT_S = 1.0
FILE_LIMIT = 256
CLOSE_S = max(LINGER_S, BODY_TIMEOUT_S) + 2.0  # the deadline plus the sweeper's tick and slack
BODY = b'{"prompt": "hi", "max_tokens": 2}'
FLAGS = (
    *("--max-connections", str(MAX_CONNECTIONS), "--pool-size", str(POOL)),
    *("--body-timeout", str(BODY_TIMEOUT_S), "--max-body-bytes", str(MIB)),
    *("--max-buffered-bytes", str(3 * MIB)),
    # pooled lane connections close soon: a request after an attack needs a fresh one
    *("--keepalive-timeout", "0.3", "--health-interval", "0.2"),
)


def _file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


@dataclass
class Endpoint:
    url: str
    pid: int
    start_hwm: float

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def memory_grown_mib(self) -> float:
        return peak_rss_mib(self.pid) - self.start_hwm

    def sockets(self) -> int:
        count = 0
        for fd in os.listdir(f"/proc/{self.pid}/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/{self.pid}/fd/{fd}").startswith("socket:")
        return count


@pytest.fixture(scope="module")
def lane() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "slurmgate.testbed.stub_server"),
            *("--port", str(port), "--tokens-per-second", "0"),
        ],
        env=python_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@pytest.fixture
async def endpoint(lane: str) -> AsyncIterator[Endpoint]:
    async with httpx.AsyncClient() as client:
        await wait_status(client, f"{lane}/health", 200, timeout=20)
    async with endpoint_process(lane, *FLAGS, env={TOKEN_ENV: TOKEN}, preexec_fn=_file_limit) as (
        url,
        proc,
    ):
        yield Endpoint(url, proc.pid, peak_rss_mib(proc.pid))


@dataclass
class Watch:
    """GET /health on its own keep-alive connection, every 50 ms, for as long as it runs."""

    url: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = await client.get(f"{self.url}/health")
                    if r.status_code != 200:
                        self.failures.append(str(r.status_code))
                except httpx.HTTPError as exc:
                    self.failures.append(type(exc).__name__)
                self.latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def watched(ep: Endpoint) -> AsyncIterator[Watch]:
    """Runs the watch through the block, then checks the bounds every test keeps."""
    watch, stop = Watch(ep.url), asyncio.Event()
    task = asyncio.create_task(watch.run(stop))
    await asyncio.sleep(0.2)  # its connection is open before the attack
    try:
        yield watch
    finally:
        stop.set()
        await task
    assert not watch.failures, watch.failures
    assert watch.latencies and max(watch.latencies) < LATENCY_S, max(watch.latencies)
    assert ep.memory_grown_mib() < MEMORY_MIB, f"peak RSS grew {ep.memory_grown_mib():.0f} MiB"


async def connect(ep: Endpoint) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*ep.address, limit=1 << 20)


async def answer(reader: asyncio.StreamReader, wait: float = 5.0) -> tuple[int, bytes]:
    """One answer: its status and its body (Content-Length framed, as every refusal is)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return int(head.split(b" ", 2)[1]), await asyncio.wait_for(reader.readexactly(length), wait)


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the endpoint closes the connection within `within` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: closed too
    return True


def post(declared: int, *, token: bool = True, path: str = "/v1/completions") -> bytes:
    auth = AUTH if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()


# ---- 1. a declared length --------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET /health", "POST /v1/completions"])
async def test_a_huge_declared_length_is_refused_at_the_head_and_never_allocated(
    endpoint: Endpoint, method: str
) -> None:
    async with watched(endpoint):
        reader, writer = await connect(endpoint)
        writer.write(
            f"{method} HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 2000000000\r\n\r\nx".encode()
        )
        status, body = await answer(reader)
        assert status == 413 and b"max-body-bytes" in body
        assert await closed_by_peer(reader, CLOSE_S)
        writer.close()


async def test_a_pipelined_huge_length_is_refused_in_its_turn_without_holding_it(
    endpoint: Endpoint,
) -> None:
    """The second request's head and 256 KiB of its body arrive while the first is answered."""
    async with watched(endpoint):
        reader, writer = await connect(endpoint)
        writer.write(post(len(BODY)) + BODY + post(2_000_000_000) + b"x" * (256 * 1024))
        first, _ = await answer(reader)
        second, _ = await answer(reader)
        assert (first, second) == (200, 413)
        assert await closed_by_peer(reader, CLOSE_S)
        writer.close()


@pytest.mark.parametrize("path", ["/health", "/metrics"])
async def test_health_and_metrics_take_no_body(endpoint: Endpoint, path: str) -> None:
    reader, writer = await connect(endpoint)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 5\r\n\r\nhello".encode())
    status, body = await answer(reader)
    writer.close()
    assert status == 400 and b"takes no body" in body


# ---- 2. a head that never ends ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "status"),
    [
        (b"GET /v1/models?q=", 414),  # the target never ends
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: ", 431),  # nor does a header value
    ],
    ids=["target", "header-value"],
)
async def test_an_endless_head_is_refused_by_its_raw_size(
    endpoint: Endpoint, start: bytes, status: int
) -> None:
    """8 MiB of a head in 64 KiB writes: refused once 64 KiB of it arrived."""
    async with watched(endpoint):
        reader, writer = await connect(endpoint)
        writer.write(start)

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                for _ in range(128):
                    writer.write(b"a" * 65536)
                    await writer.drain()

        sender = asyncio.create_task(trickle())
        got, _ = await answer(reader)
        assert got == status
        assert await closed_by_peer(reader, CLOSE_S)
        await sender
        writer.close()


# ---- 3. bodies that never come, and too many connections -------------------------------------


async def test_refused_heads_are_closed_and_cannot_take_the_lanes_file_descriptors(
    endpoint: Endpoint,
) -> None:
    """300 heads without a token, each promising one body byte that never comes, against a file
    limit of 256: each is answered 401 (or refused past the connection cap) and closed, and a
    client with the token still reaches the lane through a fresh pooled connection."""
    async with watched(endpoint), httpx.AsyncClient(timeout=10) as client:
        legit = {"Authorization": f"Bearer {TOKEN}"}
        assert await client.post(f"{endpoint.url}/v1/completions", content=BODY, headers=legit)
        attackers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        statuses: list[int | str] = []
        most_sockets = 0
        for _ in range(300):
            try:
                reader, writer = await connect(endpoint)
            except OSError as exc:
                statuses.append(type(exc).__name__)
                continue
            writer.write(post(1, token=False))
            attackers.append((reader, writer))
            most_sockets = max(most_sockets, endpoint.sockets())
        for reader, _ in attackers:
            try:
                statuses.append((await answer(reader))[0])
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                statuses.append(type(exc).__name__)
        await asyncio.sleep(0.5)  # the pooled lane connection has closed by now
        served = await client.post(f"{endpoint.url}/v1/completions", content=BODY, headers=legit)
        closed = await asyncio.gather(*(closed_by_peer(r, CLOSE_S) for r, _ in attackers))
        for _, writer in attackers:
            writer.close()
    assert served.status_code == 200, served.text
    # past the cap a connection is answered 503 and closed at once: one whose request was
    # already in may see the close as a reset instead
    at_cap = {503, "ConnectionResetError", "IncompleteReadError"}
    assert set(statuses) <= {401} | at_cap, sorted(map(str, set(statuses)))
    assert statuses.count(401) >= MAX_CONNECTIONS // 2
    assert sum(s in at_cap for s in statuses) > 0  # the cap was reached
    assert all(closed), f"{closed.count(False)} refused connections left open"
    assert most_sockets <= MAX_CONNECTIONS + POOL + 8, most_sockets


async def test_bodies_that_never_come_hold_no_budget_and_get_408(endpoint: Endpoint) -> None:
    """Three heads declaring 1 MiB each (the whole 3 MiB budget) send nothing more: another
    client's request is served meanwhile, and the three are answered 408 and closed."""
    async with watched(endpoint), httpx.AsyncClient(timeout=10) as client:
        held = [await connect(endpoint) for _ in range(3)]
        for _, writer in held:
            writer.write(post(MIB))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        r = await client.post(
            f"{endpoint.url}/v1/completions",
            content=BODY,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200, r.text
        answers = [await answer(reader, wait=CLOSE_S) for reader, _ in held]
        waited = time.monotonic() - started
        closed = [await closed_by_peer(reader, CLOSE_S) for reader, _ in held]
        for _, writer in held:
            writer.close()
    assert [status for status, _ in answers] == [408] * 3
    assert all(b"body-timeout" in body for _, body in answers)
    assert waited < BODY_TIMEOUT_S + 1.5 and all(closed)
