"""A hostile client and failing lanes against a prefill/decode endpoint: pairing, bounds, release.

The endpoint runs in this event loop (its lanes' counts, gates and pools are read directly) in
front of scripted ASGI lanes, or, to measure its memory, as its own process. First-byte timeouts
are 1-2 s, so a wait that should not happen shows as a wall-clock overrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from endpoint_helpers import (
    Backend,
    Proc,
    peak_rss_mib,
    python_env,
    serve_asgi,
    until,
    wait_status,
)

from slurmgate.runtime.endpoint.app import Endpoint, EndpointServer
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.upstream import UpstreamConnection
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


async def _post_raw(url: str, body: bytes, declared: int | None = None) -> int:
    """POST body on a raw socket (it may be refused before it is all sent); the status."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    length = len(body) if declared is None else declared
    writer.write(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())

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
    return b'{"prompt":[' + b",".join([item] * count) + b"]}"


@pytest.mark.serial  # a wall-clock bound: one at a time
async def test_large_and_costly_pd_bodies_keep_memory_and_health_bounded() -> None:
    """Three 40 MiB bodies of ``{}`` items (refused at their head), three of 8 MiB under the
    default limit but over the bracket cap, and three of 8 MiB of short strings (parsed whole,
    then refused as a batch too large), each three at once: the endpoint's peak RSS grows at most
    256 MiB and a /health polled meanwhile always answers within 1 s."""
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
            start = peak_rss_mib(proc.pid)
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
            grown = peak_rss_mib(proc.pid) - start
        finally:
            proc.kill()
            proc.wait(5)
    print(f"peak RSS grew {grown:.0f} MiB; slowest /health {max(latencies):.3f} s")
    assert grown <= 256, f"peak RSS grew {grown:.0f} MiB"
    assert max(latencies) < 1.0, max(latencies)
    assert decode.hits == prefill.hits == 0


# ---- 3. a timeout is a timeout; a lane that leaves rotation cuts its requests short ----------


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


# ---- 4. the prefill's slot is given back when its answer is in -------------------------------


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


# ---- 5. nothing is left behind ---------------------------------------------------------------


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


def _live_upstreams(ep: Endpoint) -> list[UpstreamConnection]:
    idle = {id(conn) for pool in ep.links.pools for conn in pool.idle}
    gc.collect()
    return [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, UpstreamConnection) and not obj.closed and id(obj) not in idle
    ]


@pytest.mark.serial  # a wall-clock bound: one at a time
async def test_after_killed_hung_and_slow_lanes_and_vanished_clients_nothing_is_held() -> None:
    """A killed prefill lane, a decode lane that hangs after two answers, a slow streaming one,
    and clients that leave mid-stream: once the load stops, every lane's count and gate are back
    within 2 s, and no task and no upstream connection outlives its request."""
    boots = [free_port(), free_port()]
    procs = [
        _stub("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot))
        for boot in boots
    ]
    procs += [
        _stub("--disaggregation-mode", "decode", "--tokens-per-second", "20"),
        _stub("--disaggregation-mode", "decode", "--wedge-after", "2", "--bootstrap-timeout", "2"),
    ]
    try:
        async with httpx.AsyncClient(timeout=20) as client:
            for proc in procs:
                await wait_status(client, f"{proc.url}/health", 200, timeout=20)
            config = EndpointConfig(
                name="pd",
                prefill=[
                    {"url": p.url, "bootstrap_port": b} for p, b in zip(procs, boots, strict=False)
                ],
                decode=[procs[2].url, procs[3].url],
                **FAST,
            )
            server = EndpointServer(config)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.bind(("127.0.0.1", 0))
            await server.start(sock)
            ep, url = server.endpoint, f"http://127.0.0.1:{server.port}"
            before = set(asyncio.all_tasks())
            try:
                await _load(client, url, kill=lambda: os.killpg(procs[1].popen.pid, signal.SIGKILL))
                per_lane = max(1, config.pool_size // len(ep.lanes))

                def settled() -> bool:
                    held = [
                        (lane.active, lane.queued, len(lane.awaiting), len(lane.cut_off))
                        for lane in ep.lanes
                    ]
                    gates = [gate._value for gate in ep.links.gates]
                    return set(held) == {(0, 0, 0, 0)} and set(gates) == {per_lane}

                started = time.monotonic()
                await until(settled, timeout=2.0)
                print(f"settled in {time.monotonic() - started:.2f} s; {dict(ep.stats.statuses)}")
                await until(lambda: set(asyncio.all_tasks()) <= before | {asyncio.current_task()})
                assert _live_upstreams(ep) == []
            finally:
                await server.stop()
                sock.close()
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.wait(5)


async def _load(client: httpx.AsyncClient, url: str, kill: Callable[[], None]) -> None:
    """24 requests at once, half of them streams; a third of the clients leave after 0.5 s,
    and a prefill lane is killed at 0.3 s."""

    async def one(i: int) -> None:
        body: dict[str, Any] = {"prompt": f"p{i}", "max_tokens": 30, "stream": i % 2 == 0}
        with contextlib.suppress(httpx.HTTPError):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
                async for _ in answer.aiter_bytes():
                    pass

    tasks = [asyncio.create_task(one(i)) for i in range(24)]
    await asyncio.sleep(0.3)
    kill()
    await asyncio.sleep(0.2)
    for task in tasks[::3]:
        task.cancel()
    await asyncio.wait(tasks, timeout=20)
    assert all(task.done() for task in tasks)
