"""A hostile client and failing lanes against a prefill/decode endpoint: pairing, bounds, release.

The endpoint runs in this event loop (its lanes' counts, gates and pools are read directly) in
front of scripted ASGI lanes, or, to measure its memory, as its own process: the fault run's
(``pd_probe.py``) reports what it holds over a side door. First-byte timeouts are 1-2 s, so a
wait that should not happen shows as a wall-clock overrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from endpoint_helpers import (
    Backend,
    Proc,
    alive,
    parser_of,
    peak_rss_mib,
    python_env,
    serve_asgi,
    until,
    wait_status,
)

from slurmgate.runtime.endpoint import pd
from slurmgate.runtime.endpoint.app import Endpoint, EndpointServer
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.pdparser import INLINE_BYTES, ChildParser
from slurmgate.testbed.localproc import free_port

MIB = 1024 * 1024
EVIL = "10.9.9.9"
SPOOF = {"prompt": "x", "bootstrap_host": EVIL, "bootstrap_port": 1, "bootstrap_room": 3}
FAST = {"health_interval": 0.2, "first_byte_timeout": 2.0}


@contextlib.asynccontextmanager
async def pd_endpoint(
    prefill: list[str], decode: list[str], **settings: Any
) -> AsyncIterator[tuple[str, Endpoint]]:
    """The endpoint over prefill lanes (bootstrap port 8998) and decode lanes, in this loop."""
    config = EndpointConfig(
        name="pd",
        prefill=[{"url": url, "bootstrap_port": 8998} for url in prefill],
        decode=decode,
        **{**FAST, **settings},
    )
    server = EndpointServer(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    await server.start(sock)
    try:
        yield f"http://127.0.0.1:{server.port}", server.endpoint
    finally:
        await server.stop()
        sock.close()


@contextlib.asynccontextmanager
async def lanes(*apps: Backend) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_asgi(app)) for app in apps]


def fields_of(body: bytes) -> tuple[Any, Any]:
    """The bootstrap fields of a body a lane got: plain UTF-8 JSON, one object."""
    assert body.startswith(b"{"), body[:40]
    sent = json.loads(body.decode("utf-8"))
    return sent.get("bootstrap_host"), sent.get("bootstrap_room")


# ---- 1. every request is paired or refused ---------------------------------------------------

SPOOFED = json.dumps(SPOOF).encode()
PLAIN = json.dumps({"prompt": "x"})  # no bootstrap field of the client's own


@pytest.mark.parametrize(
    ("method", "body", "status"),
    [
        ("POST", b"\xef\xbb\xbf" + SPOOFED, 200),  # a UTF-8 byte order mark
        ("POST", b"\r\n \t" + SPOOFED + b"\n", 200),  # whitespace around the object
        ("POST", json.dumps(SPOOF).encode("utf-16"), 200),  # JSON the engine reads as UTF-16
        # without a byte order mark, the first byte is still `{`: UTF-16 or 32 all the same
        ("POST", PLAIN.encode("utf-16-le"), 200),
        ("POST", PLAIN.encode("utf-32-le"), 200),
        ("PUT", SPOOFED, 200),  # SGLang serves PUT /generate
        ("POST", b"[" + SPOOFED + b"]", 400),  # not an object
        ("POST", b'"' + EVIL.encode() + b'"', 400),
        ("POST", b"\x00" + SPOOFED, 400),  # not JSON at all
        ("GET", SPOOFED, 400),  # a body on a GET
        ("PATCH", SPOOFED, 405),
        ("DELETE", SPOOFED, 405),
    ],
    ids=[
        "bom",
        "space",
        "utf16",
        "utf16le",
        "utf32le",
        "put",
        "array",
        "string",
        "nul",
        "get",
        "patch",
        "delete",
    ],
)
async def test_a_pd_request_is_paired_or_refused_never_proxied_with_a_clients_fields(
    method: str, body: bytes, status: int
) -> None:
    prefill, decode = Backend("prefill"), Backend("decode")
    async with (
        lanes(prefill, decode) as (p_url, d_url),
        pd_endpoint([p_url], [d_url]) as (url, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        got = await client.request(method, f"{url}/generate", content=body)
        assert got.status_code == status, got.text
        if status == 405:
            assert got.headers["allow"] == "GET, HEAD, POST, PUT"
        # a GET without a body (a model list, say) is not paired: it reaches a decode lane
        assert (await client.get(f"{url}/v1/models")).status_code == 200
    assert decode.hits == 1 + (status == 200)
    for seen in decode.seen_bodies[:-1] + prefill.seen_bodies:
        host, room = fields_of(seen)
        assert host == "127.0.0.1" and isinstance(room, int) and room != 3
        assert EVIL.encode() not in seen
    assert decode.seen_bodies[-1] == b""
    assert prefill.hits == (status == 200)


# ---- 2. a PD body is bounded before it is parsed ---------------------------------------------


def _watch_health(url: str, latencies: list[float], stop: asyncio.Event) -> asyncio.Task[None]:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert (await client.get(f"{url}/health")).status_code == 200
                latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.05)

    return asyncio.create_task(run())


async def _post_raw(url: str, body: bytes, path: str = "/generate") -> int:
    """POST body on a raw socket (it may be refused before it is all sent); the status."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    length = len(body)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())

    async def send() -> None:
        with contextlib.suppress(OSError):
            for start in range(0, len(body), MIB):
                writer.write(body[start : start + MIB])
                await writer.drain()

    sender = asyncio.create_task(send())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    sender.cancel()
    writer.close()
    return int(head.split(b" ", 2)[1])


def _list_body(item: bytes, size: int) -> bytes:
    """``{"prompt":[item,item,...]}`` of about ``size`` bytes."""
    count = (size - 16) // (len(item) + 1)
    return b'{"prompt":[' + (item + b",") * (count - 1) + item + b"]}"


def _token_ids(rows: int) -> bytes:
    """``{"input_ids":[[123,...],...],"max_tokens":4}``: ``rows`` sequences of token ids, just
    under the comma cap and the 8 MiB limit: with 4,097 rows, about 2 million numbers in
    7.6 MiB, the costliest parse per byte the caps let through."""
    per_row = pd.MAX_VALUES // rows - 1
    row = b"[" + b"123," * (per_row - 1) + b"123]"
    return b'{"input_ids":[' + b",".join([row] * rows) + b'],"max_tokens":4}'


@pytest.mark.serial  # a wall-clock bound: one at a time
async def test_large_and_costly_pd_bodies_keep_memory_and_health_bounded() -> None:
    """Three 40 MiB bodies of ``{}`` items (refused at their head), three of 8 MiB under the
    default limit but over the bracket cap, and three of 8 MiB of short strings (parsed whole,
    in the parser process, then refused as a batch too large), each three at once: the peak
    RSS of the endpoint and of its parser process grow at most 256 MiB together, and a /health
    polled meanwhile always answers within 1 s."""
    prefill, decode = Backend("prefill"), Backend("decode")
    async with lanes(prefill, decode) as (p_url, d_url):
        port = free_port()
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "slurmgate.runtime.endpoint", "--name", "pd"),
                *("--listen", f"127.0.0.1:{port}", "--prefill", p_url, "8998"),
                *("--decode", d_url, "--max-buffered-bytes", str(512 * MIB)),
            ],
            env=python_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient() as client:
                await wait_status(client, f"{url}/health", 200, timeout=20)
            bodies = [  # built before the watch: building them stalls this event loop
                (_list_body(b"{}", 40 * MIB), 413),
                (_list_body(b"{}", 8 * MIB - 64), 400),
                (_list_body(b'"abcdefgh"', 8 * MIB - 64), 400),
            ]
            parser = parser_of(proc.pid)
            start = peak_rss_mib(proc.pid), peak_rss_mib(parser)
            latencies: list[float] = []
            stop = asyncio.Event()
            watch = _watch_health(url, latencies, stop)
            await asyncio.sleep(0.2)
            for body, status in bodies:
                got = await asyncio.gather(*(_post_raw(url, body) for _ in range(3)))
                assert got == [status] * 3
            await asyncio.sleep(0.3)
            stop.set()
            await watch
            # the same parser process: its peak is the whole run's
            assert parser_of(proc.pid) == parser
            own, parsing = peak_rss_mib(proc.pid) - start[0], peak_rss_mib(parser) - start[1]
        finally:
            proc.kill()
            proc.wait(5)
    grown = own + parsing
    print(
        f"peak RSS grew {grown:.0f} MiB (the endpoint {own:.0f}, its parser {parsing:.0f}); "
        f"slowest /health {max(latencies):.3f} s"
    )
    assert grown <= 256, f"peak RSS grew {grown:.0f} MiB"
    assert max(latencies) < 1.0, max(latencies)
    assert decode.hits == prefill.hits == 0


# ---- 3. a large body is parsed in a process of its own: replaced, bounded, never left --------


def _parser(ep: Endpoint) -> ChildParser:
    assert ep.paired is not None
    return ep.paired.parser


async def test_a_parser_killed_mid_parse_fails_its_request_and_a_new_one_takes_the_next() -> None:
    prefill, decode = Backend("prefill"), Backend("decode")
    costly = _token_ids(pd.MAX_BATCH + 1)  # about 0.5 s to parse
    async with (
        lanes(prefill, decode) as (p_url, d_url),
        pd_endpoint([p_url], [d_url]) as (url, ep),
        httpx.AsyncClient(timeout=30) as client,
    ):
        parser = _parser(ep)
        first = parser.start()
        posting = asyncio.create_task(client.post(f"{url}/generate", content=costly))
        await until(lambda: parser.current is not None, timeout=10)
        os.kill(first.pid, signal.SIGKILL)
        killed = await posting
        assert killed.status_code == 503, killed.text
        assert "body parser stopped during the parse" in killed.json()["error"]["message"]
        assert first.returncode == -signal.SIGKILL  # reaped, not left a zombie
        # a new parser took its place at once, and pairs the next large body
        assert parser.started == 2 and parser.start().pid != first.pid
        big = {"prompt": "x" * (INLINE_BYTES + 1), "max_tokens": 4}
        assert (await client.post(f"{url}/generate", json=big)).status_code == 200
        assert ep.stats.pd_parse_failures == 1
    assert [fields_of(body)[0] for body in decode.seen_bodies] == ["127.0.0.1"]
    assert parser.process is not None and parser.process.returncode is not None  # stopped


async def test_a_parse_over_its_time_limit_is_answered_413_and_the_parser_replaced() -> None:
    prefill, decode = Backend("prefill"), Backend("decode")
    costly = _token_ids(pd.MAX_BATCH + 1)  # about 0.5 s to parse, more under load
    async with (
        lanes(prefill, decode) as (p_url, d_url),
        pd_endpoint([p_url], [d_url], pd_parse_timeout=0.1) as (url, ep),
        httpx.AsyncClient(timeout=30) as client,
    ):
        parser = _parser(ep)
        first = parser.start()
        over = await client.post(f"{url}/generate", content=costly)
        assert over.status_code == 413, over.text
        assert "over 0.1 s to parse (--pd-parse-timeout)" in over.json()["error"]["message"]
        assert first.returncode == -signal.SIGKILL
        assert parser.started == 2
        parser.time_limit = 30  # a limit the new parser meets even while it still starts
        big = {"prompt": "x" * (INLINE_BYTES + 1), "max_tokens": 4}
        assert (await client.post(f"{url}/generate", json=big)).status_code == 200
    assert decode.hits == prefill.hits == 1


def _cpu_ticks(pid: int) -> int:
    """The CPU time a process has used, in clock ticks (user and system)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.parametrize("moment", ["idle", "mid-parse"])
async def test_no_parser_is_left_when_the_endpoint_is_killed(moment: str) -> None:
    """SIGKILL gives the endpoint no chance to stop its parser: the parser ends on its own,
    idle (its stdin closes) or mid-parse (its parent-death signal)."""
    prefill, decode = Backend("prefill"), Backend("decode")
    async with lanes(prefill, decode) as (p_url, d_url):
        port = free_port()
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "slurmgate.runtime.endpoint", "--name", "pd"),
                *("--listen", f"127.0.0.1:{port}", "--prefill", p_url, "8998"),
                *("--decode", d_url),
            ],
            env=python_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        posting: asyncio.Task[int] | None = None
        try:
            async with httpx.AsyncClient() as client:
                await wait_status(client, f"{url}/health", 200, timeout=20)
            parser = parser_of(proc.pid)
            if moment == "mid-parse":
                idle = _cpu_ticks(parser)
                posting = asyncio.create_task(_post_raw(url, _token_ids(pd.MAX_BATCH + 1)))
                await until(lambda: _cpu_ticks(parser) > idle + 10, timeout=10)  # 0.1 s in
            proc.kill()
            proc.wait(5)
            await until(lambda: not alive(parser), timeout=2)
        finally:
            proc.kill()
            proc.wait(5)
            if posting is not None:
                posting.cancel()
                await asyncio.gather(posting, return_exceptions=True)


# ---- 4. a timeout is a timeout; a lane that leaves rotation cuts its requests short ----------


@pytest.mark.serial  # a wall-clock bound: one at a time
async def test_a_first_byte_timeout_on_a_reused_connection_is_answered_504_once() -> None:
    prefill, decode = Backend("prefill"), Backend("decode")
    async with (
        lanes(prefill, decode) as (p_url, d_url),
        pd_endpoint([p_url], [d_url], first_byte_timeout=1.0) as (url, _),
        httpx.AsyncClient(timeout=10) as client,
    ):
        assert (await client.post(f"{url}/generate", json={"text": "a"})).status_code == 200
        decode.hang = True  # the next request goes out on the pooled (reused) connection
        started = time.monotonic()
        got = await client.post(f"{url}/generate", json={"text": "b"})
        waited = time.monotonic() - started
    assert got.status_code == 504, got.text
    assert waited < 1.8, f"answered after {waited:.1f} s"
    assert decode.hits == 2 and prefill.hits == 2  # sent once, never again


@pytest.mark.serial  # a wall-clock bound: one at a time
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_lane_leaving_rotation_cuts_its_pd_requests_short(role: str) -> None:
    prefill, decode = Backend("prefill"), Backend("decode")
    wedged = prefill if role == "prefill" else decode
    # The first-byte timeout is 2 s; two failed probes 0.2 s apart take the lane out in about
    # 0.4 s. A cut at the timeout would answer 504 after 2 s: the 503 naming the rotation, well
    # before it, is the cut.
    async with (
        lanes(prefill, decode) as (p_url, d_url),
        pd_endpoint([p_url], [d_url], first_byte_timeout=2.0) as (url, ep),
        httpx.AsyncClient(timeout=10) as client,
    ):
        wedged.hang = True
        started = time.monotonic()
        request = asyncio.create_task(client.post(f"{url}/generate", json={"text": "a"}))
        await until(lambda: wedged.hits == 1)
        wedged.health_status = 503  # its engine wedged: the health probes take it out
        got = await request
        waited = time.monotonic() - started
        assert all(lane.active == 0 for lane in ep.lanes)
    assert got.status_code == 503 and "left rotation" in got.text, got.text
    assert waited < 1.5, f"answered after {waited:.1f} s"


# ---- 5. the prefill's slot is given back when its answer is in -------------------------------


@pytest.mark.serial  # a wall-clock bound: one at a time
async def test_a_prefill_lane_is_free_while_its_decode_still_streams() -> None:
    """One connection per lane: a request whose decode takes 1.5 s (under the 2 s first-byte
    timeout) holds no prefill slot, so a second request pairs the same prefill lane with the
    idle decode lane at once, not after the first one's 1.5 s."""
    prefill, slow, idle = Backend("prefill"), Backend("slow", delay=1.5), Backend("idle")
    async with (
        lanes(prefill, slow, idle) as (p_url, slow_url, idle_url),
        pd_endpoint([p_url], [slow_url, idle_url], pool_size=3) as (url, ep),
        httpx.AsyncClient(timeout=10) as client,
    ):
        first = asyncio.create_task(client.post(f"{url}/generate", json={"text": "a"}))
        await until(lambda: slow.hits == 1 and prefill.hits == 1)
        await until(lambda: ep.lanes[0].active == 0, timeout=1.0)
        started = time.monotonic()
        second = await client.post(f"{url}/generate", json={"text": "b"})
        waited = time.monotonic() - started
        assert not first.done()
        assert (await first).status_code == 200
    assert second.status_code == 200 and second.json()["backend"] == "idle"
    assert waited < 1.0, f"the second request waited {waited:.1f} s"


# ---- 6. faults under load: the bounds hold, and nothing is left behind ----------------------

FIRST_BYTE = 1.5  # the fault run's first-byte timeout
SLOW_START = 0.5  # the slow decode lane starts each answer this late: well within FIRST_BYTE
# Each lane's stub knobs. A prefill takes a while, so requests are in flight on the killed lane
# when it dies right after its second answer (--crash-after: at a known request). The hung lane
# takes every request and never starts an answer while its /health says 200, so the first-byte
# timeout, not its leaving rotation, ends them.
FAULT_LANES = {
    "prefill-ok": ["--first-token-delay", "0.15"],
    "prefill-killed": ["--first-token-delay", "0.4", "--crash-after", "2"],
    "decode-fast": ["--tokens-per-second", "200"],
    "decode-slow": ["--first-token-delay", str(SLOW_START)],
    "decode-hung": ["--first-token-delay", "600"],
}
PACED, PACE = 40, 0.06  # completions: at least 40, one every 60 ms, every other one streamed
PROBE = Path(__file__).with_name("pd_probe.py")
T = TypeVar("T")


def _stub(*args: str) -> Proc:
    port = free_port()
    popen = subprocess.Popen(
        [sys.executable, "-m", "slurmgate.testbed.stub_server", "--port", str(port), *args],
        env=python_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Proc(popen, f"http://127.0.0.1:{port}", port)


async def _probe(port: int, full: bool = False) -> dict[str, Any]:
    """What the endpoint process holds now (``pd_probe.py``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=MIB)
    writer.write(b"full\n" if full else b"now\n")
    try:
        return dict(json.loads(await asyncio.wait_for(reader.readline(), 10)))
    finally:
        writer.close()


def _settled(state: dict[str, Any], sent: int) -> bool:
    """Every request sent has ended, and every lane's counts and gate are back."""
    return (
        all(counts == [0, 0, 0, 0] for counts in state["lanes"])
        and set(state["gates"]) == {state["per_lane"]}
        and state["requests_open"] == 0
        and state["ended"] == sent
    )


async def _running(url: str) -> float:
    """A stub lane's requests being generated (its vllm:num_requests_running gauge)."""
    async with httpx.AsyncClient(timeout=5) as client:
        page = (await client.get(f"{url}/metrics")).text
    line = next(line for line in page.splitlines() if line.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


class _HealthWatch(threading.Thread):
    """GET /health every 50 ms on a new connection, from a thread of its own: the latency is
    the endpoint's, not that of the test's busy event loop. It answers 200, or 503 while a lane
    is down (the killed one is)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                conn.request("GET", "/health")
                answer = conn.getresponse()
                answer.read()
                if answer.status not in (200, 503):
                    self.failures.append(f"/health answered {answer.status}")
            except OSError as exc:
                self.failures.append(repr(exc))
            finally:
                conn.close()
            self.latencies.append(time.monotonic() - started)
            self.halt.wait(0.05)


@dataclass
class _Load:
    """The clients' side: requests sent, and when the load stopped: the moment the last
    client sent a request, read the last byte it read, or let a request go."""

    url: str
    sent: int = 0
    stopped: float = 0.0

    def send(self) -> None:
        self.sent += 1
        self.act()

    def act(self) -> None:
        self.stopped = max(self.stopped, time.monotonic())


async def _paced(client: httpx.AsyncClient, load: _Load, i: int) -> tuple[int, float, bytes]:
    """One completion read whole: its status, the seconds until its head, its body."""
    body = {"prompt": f"p{i}", "max_tokens": 30, "stream": i % 2 == 0}
    load.send()
    started = time.monotonic()
    async with client.stream("POST", f"{load.url}/v1/completions", json=body) as answer:
        waited = time.monotonic() - started
        data = await answer.aread()
    return answer.status_code, waited, data


async def _pace(
    client: httpx.AsyncClient, load: _Load, busy: Callable[[], bool]
) -> list[asyncio.Task[tuple[int, float, bytes]]]:
    """Completions sent one every PACE seconds, at least PACED of them, and on while ``busy``
    says another client still acts (15 s at most): the last of them stops the load."""
    tasks: list[asyncio.Task[tuple[int, float, bytes]]] = []
    began = time.monotonic()
    while len(tasks) < PACED or (busy() and time.monotonic() - began < 15):
        tasks.append(asyncio.create_task(_paced(client, load, len(tasks))))
        await asyncio.sleep(PACE)
    return tasks


async def _stream(
    load: _Load, max_tokens: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed completion answered 200, on a connection that takes little ahead of its
    reader (a 4 KiB socket buffer, 2 KiB in the stream reader), so reading it slowly holds the
    endpoint's writes back. Sent again while the hung or the killed lane answers it 504 or 502."""
    host, port = load.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "s", "max_tokens": max_tokens, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    for _ in range(8):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        writer.write(request)
        await writer.drain()
        load.send()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if head.startswith(b"HTTP/1.1 200 "):
            return reader, writer
        writer.close()  # that answer was whole: nothing is let go
    raise AssertionError("no streamed answer in 8 attempts")


async def _read_slowly(load: _Load, max_tokens: int, seconds: float) -> tuple[bytes, int]:
    """Read a stream 64 bytes at a time, 10 ms apart, to its end or for ``seconds``, then
    leave; what was read, and in how many reads."""
    reader, writer = await _stream(load, max_tokens)
    got, reads = bytearray(), 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not got.endswith(b"\r\n0\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(64), 5)
        if not chunk:
            break
        got += chunk
        reads += 1
        await asyncio.sleep(0.01)
    writer.close()
    load.act()
    return bytes(got), reads


async def _vanish(load: _Load) -> bytes:
    """Take a stream's first bytes, then leave with hundreds of its tokens still to come."""
    reader, writer = await _stream(load, 400)
    got = await asyncio.wait_for(reader.read(64), 5)
    writer.close()
    load.act()
    return got


async def _post_big(load: _Load, body: bytes) -> int:
    """A big body, and its answer read: the client acts until then (a body that is paired
    waits for its parse, one at a time, and for both lanes' answers)."""
    load.send()
    status = await _post_raw(load.url, body, "/v1/completions")
    load.act()
    return status


async def _at(delay: float, work: Awaitable[T]) -> T:
    await asyncio.sleep(delay)
    return await work


def _fault_bodies() -> list[tuple[float, bytes]]:
    """The big bodies, each sent three times at once, and when: 40 MiB (refused at its head),
    8 MiB of short strings (parsed whole, then refused as a batch too large), an 8 MiB prompt
    (parsed, paired and sent to both lanes), and 7.6 MiB of token ids in 4,097 sequences, one
    more than a batch may have (parsed whole, then refused: the lanes, which parse in Python
    too, would stall on it and blur the faults asserted here)."""
    huge = _list_body(b"{}", 40 * MIB)
    costly = _list_body(b'"abcdefgh"', 8 * MIB - 64)
    prompt = b'{"prompt":"' + b"x" * (8 * MIB - 64) + b'","max_tokens":4}'
    ids = _token_ids(pd.MAX_BATCH + 1)
    assert len(ids) < 8 * MIB and pd.shape_error(ids) is None
    return [(0.6, huge), (1.0, costly), (1.4, prompt), (1.8, ids)]


@pytest.mark.serial  # a wall-clock bound: one at a time
async def test_after_killed_hung_and_slow_lanes_and_vanished_clients_nothing_is_held() -> None:
    """Paced completions meet a prefill lane killed at a known request, a decode lane that
    hangs while its /health says 200, a slow one, two clients that read a stream 64 bytes at a
    time (one to its end, one leaves), six that leave mid-stream, and the big bodies:

    - each fault shows: the killed lane's requests are answered 502, the hung lane's 504 at
      the first-byte timeout, the slow lane's 200 late;
    - the peak RSS of the endpoint process and of its parser process grow at most 256 MiB
      together, and a /health polled from another thread always answers within 1 s;
    - every lane's counts and gate are back within 2 s of the load's stop (the last request
      sent, read or let go), and then no task and no upstream connection is left."""
    lanes_up: list[tuple[str, Proc, int | None]] = []
    for name, knobs in FAULT_LANES.items():
        role = name.split("-")[0]
        boot = free_port() if role == "prefill" else None
        pairing = [] if boot is None else ["--disaggregation-bootstrap-port", str(boot)]
        proc = _stub(
            *("--disaggregation-mode", role, *pairing, "--served-model-name", name),
            *("--max-concurrency", "256", "--bootstrap-timeout", "5", *knobs),
        )
        lanes_up.append((name, proc, boot))
    procs = {name: proc for name, proc, _ in lanes_up}
    port, probe_port = free_port(), free_port()
    flags = ["--name", "pd", "--listen", f"127.0.0.1:{port}", "--health-interval", "0.2"]
    flags += ["--first-byte-timeout", str(FIRST_BYTE)]
    for _, proc, boot in lanes_up:
        flags += ["--decode", proc.url] if boot is None else ["--prefill", proc.url, str(boot)]
    endpoint: subprocess.Popen[bytes] | None = None
    watch = _HealthWatch(port)
    try:
        endpoint = subprocess.Popen(
            [sys.executable, str(PROBE), str(probe_port), *flags],
            env=python_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=20) as client:
            # the endpoint's /health answers 200 once it probed every lane up
            await wait_status(client, f"{url}/health", 200, timeout=30)
        await _probe(probe_port)  # the first report: what runs before any request
        bodies = _fault_bodies()  # built before the run: building them stalls this event loop
        parser = parser_of(endpoint.pid)
        rss_before = peak_rss_mib(endpoint.pid), peak_rss_mib(parser)
        watch.start()
        load = _Load(url)
        began = time.monotonic()
        async with httpx.AsyncClient(timeout=20) as client:
            readers = [
                asyncio.create_task(_at(0.3, _read_slowly(load, 40, 10.0))),  # to its end
                asyncio.create_task(_at(0.4, _read_slowly(load, 1000, 1.0))),  # then leaves
            ]
            vanishers = [asyncio.create_task(_at(0.3 + 0.2 * k, _vanish(load))) for k in range(6)]
            big = [
                asyncio.create_task(_at(start, _post_big(load, body)))
                for start, body in bodies
                for _ in range(3)
            ]
            others = readers + vanishers + big
            paced = await _pace(client, load, lambda: not all(t.done() for t in others))
            # the load has stopped: from its last act on, the endpoint has 2 s to settle
            state = await _probe(probe_port)
            while not _settled(state, load.sent) and time.monotonic() < load.stopped + 8:
                await asyncio.sleep(0.02)
                state = await _probe(probe_port)
            settle = time.monotonic() - load.stopped
            results = await asyncio.wait_for(asyncio.gather(*paced), 10)
            big_statuses = await asyncio.wait_for(asyncio.gather(*big), 10)
        watch.halt.set()
        watch.join(5)
        # every client has closed its connections: nothing may be left on the endpoint's side
        deadline = time.monotonic() + 3
        after = await _probe(probe_port, full=True)
        while after["new_tasks"] or after["live_upstreams"] or after["connections"]:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
            after = await _probe(probe_port, full=True)
        assert parser_of(endpoint.pid) == parser  # the same one: its peak is the whole run's
        own = peak_rss_mib(endpoint.pid) - rss_before[0]
        parsing = peak_rss_mib(parser) - rss_before[1]
        grown = own + parsing
        took = time.monotonic() - began
        hung_running = await _running(procs["decode-hung"].url)
        killed = procs["prefill-killed"].popen.poll()
        assert endpoint.poll() is None, "the endpoint died"
    finally:
        watch.halt.set()
        if endpoint is not None:
            endpoint.kill()
            endpoint.wait(5)
        for proc in procs.values():
            if proc.popen.poll() is None:  # not reaped yet: the group is still ours
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.wait(5)

    statuses = Counter(status for status, _, _ in results)
    slowest = max(watch.latencies)
    print(
        f"\nfault run: paced {dict(sorted(statuses.items()))}, big bodies {big_statuses}; "
        f"the endpoint answered {after['statuses']}\n"
        f"bounds: peak RSS grew {grown:.0f} MiB (the endpoint {own:.0f}, its parser "
        f"{parsing:.0f}); slowest /health {slowest:.3f} s of "
        f"{len(watch.latencies)}; settled {settle:.2f} s after the load stopped; "
        f"longest event-loop stall {after['longest_stall']:.3f} s; whole run {took:.1f} s; "
        f"client write pauses {after['client_write_pauses']}"
    )
    # each fault was hit
    dropped = [body for status, _, body in results if status in (502, 503)]
    assert killed == 1, f"the killed prefill lane is still up ({killed})"
    assert any(b"prefill backend" in body for body in dropped), statuses
    timed_out = [(waited, body) for status, waited, body in results if status == 504]
    assert timed_out and all(b"decode backend did not answer" in body for _, body in timed_out)
    assert min(waited for waited, _ in timed_out) >= FIRST_BYTE, timed_out
    assert len(timed_out) <= hung_running  # each 504 is a request the hung lane still holds
    late = [waited for status, waited, body in results if status == 200 and b"decode-slow" in body]
    assert late and min(late) >= SLOW_START, late
    assert any(status == 200 and b"decode-fast" in body for status, _, body in results)
    assert set(statuses) <= {200, 502, 503, 504}, statuses
    # the slow readers and the clients that left
    (whole, whole_reads), (part, part_reads) = (task.result() for task in readers)
    assert whole.endswith(b"\r\n0\r\n\r\n") and b"data: [DONE]" in whole and whole_reads > 50
    assert part_reads > 20 and not part.endswith(b"\r\n0\r\n\r\n")
    assert all(task.result() for task in vanishers)
    left = len(vanishers) + 1  # and the slow reader that left: each one mid-stream
    assert after["statuses"].get("499", 0) >= left, after["statuses"]
    assert big_statuses[:6] == [413] * 3 + [400] * 3, big_statuses
    assert set(big_statuses[6:9]) <= {200, 502, 503, 504}, big_statuses
    assert big_statuses[9:] == [400] * 3, big_statuses
    # nothing is left, and each request was answered once
    assert after["ended"] == load.sent, (after, load.sent)
    assert after["new_tasks"] == [] and after["live_upstreams"] == 0, after
    assert after["connections"] == 0, after
    assert not watch.failures, watch.failures[:3]
    # the bounds, each one named when it is missed
    bounds = {
        f"peak RSS grew {grown:.0f} MiB (at most 256)": grown <= 256,
        f"the slowest /health took {slowest:.2f} s (under 1)": slowest < 1,
        f"settled {settle:.2f} s after the load stopped (at most 2): {state}": settle <= 2,
        f"the run took {took:.0f} s (at most 60)": took <= 60,
    }
    assert all(bounds.values()), [bound for bound, held in bounds.items() if not held]
