"""The endpoint's data plane speaks HTTP/1.1 to clients and lanes: raw exchanges over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from endpoint_helpers import Backend, running_backends, running_endpoint, serve_asgi, until

from slurmgate.runtime.endpoint.dataplane import ClientConnection, Handler, Incoming
from slurmgate.runtime.endpoint.forward import BrokenStream, relay
from slurmgate.runtime.endpoint.upstream import QUICKACK, LanePool, UpstreamConnection

BODY = b'{"model": "m", "prompt": "hi"}'


def post(target: str = "/v1/completions", extra: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST {target} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n{extra}\r\n"
    ).encode() + BODY


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    data = bytearray()
    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(1 << 20):
                data += chunk
    return bytes(data)


async def test_pipelined_requests_are_answered_in_order() -> None:
    a = Backend("a")
    async with running_backends(a) as urls, running_endpoint(urls) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # three requests in one write; the last asks to close, so the answer ends at EOF
        writer.write(post("/v1/one") + post("/v1/two") + post("/v1/three", "Connection: close\r\n"))
        data = await read_until_closed(reader)
        writer.close()
    assert data.count(b"HTTP/1.1 200 OK") == 3
    assert a.hits == 3
    assert [h["content-length"] for h in a.seen_headers] == [str(len(BODY))] * 3
    assert a.seen_bodies == [BODY] * 3


async def test_an_http10_client_gets_a_stream_that_ends_at_the_close() -> None:
    async def sse(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] != "/v1/completions":  # probes and scrapes
            await send({"type": "http.response.body", "body": b""})
            return
        for i in range(3):
            await send(
                {"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True}
            )
        await send({"type": "http.response.body", "body": b""})

    async with serve_asgi(sse) as backend, running_endpoint([backend]) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(post(version="1.0"))
        data = await read_until_closed(reader)
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()  # HTTP/1.0 knows no chunks
    assert b"connection: close" in head.lower()
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    a = Backend("a")
    async with running_backends(a) as urls, running_endpoint(urls) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = post(extra="Expect: 100-continue\r\n")[: -len(BODY)]
        writer.write(head)
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(BODY)
        final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
        writer.close()
    assert final.startswith(b"HTTP/1.1 200")
    assert a.seen_bodies == [BODY]


async def test_a_lane_closing_its_idle_connections_costs_no_retry(
    client: httpx.AsyncClient,
) -> None:
    a = Backend("a")
    async with (
        serve_asgi(a, timeout_keep_alive=0.2) as backend,
        running_endpoint([backend]) as (url, ep),
    ):
        first = await client.post(f"{url}/v1/completions", content=BODY)
        await asyncio.sleep(0.6)  # the lane has closed the pooled connection by now
        second = await client.post(f"{url}/v1/completions", content=BODY)
    assert (first.status_code, second.status_code) == (200, 200)
    assert ep.stats.retries == {} and a.hits == 2
    assert len(a.client_ports) == 2  # a fresh connection, not the closed one


CHUNKS = 96  # MiB: more than the loopback socket buffers on the way can hold


async def test_a_client_that_stops_reading_pauses_the_lane() -> None:
    """A stream the client does not read is not buffered here: the lane is made to wait."""
    sent = 0
    chunk = b"x" * (1024 * 1024)

    async def firehose(scope: Any, receive: Any, send: Any) -> None:
        nonlocal sent
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] != "/v1/completions":  # probes and scrapes
            await send({"type": "http.response.body", "body": b""})
            return
        for _ in range(CHUNKS):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += 1
        await send({"type": "http.response.body", "body": b""})

    async with serve_asgi(firehose) as backend, running_endpoint([backend]) as (url, ep):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=65536)
        writer.write(post(extra="Connection: close\r\n"))
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(1.0)  # the client reads nothing more
        stalled_at = sent
        data = await read_until_closed(reader, timeout=30)
        writer.close()
    # without flow control the endpoint would take it all from the lane and hold it
    assert stalled_at < CHUNKS, f"the lane sent all {stalled_at} MiB to a client that read none"
    # and /metrics says so
    assert ep.stats.client_write_pauses >= 1 and ep.stats.lane_reads_paused >= 1, ep.stats
    assert sent == CHUNKS
    assert data.count(b"x") == CHUNKS * len(chunk)


async def test_a_head_request_gets_the_head_only(client: httpx.AsyncClient) -> None:
    a = Backend("a")
    async with running_backends(a) as urls, running_endpoint(urls) as (url, ep):
        r = await client.head(f"{url}/v1/models")
        again = await client.post(f"{url}/v1/completions", content=BODY)
        await until(lambda: ep.lanes[0].active == 0)
    assert r.status_code == 200 and r.content == b""
    assert int(r.headers["content-length"]) > 0  # the length the lane announced
    assert again.status_code == 200 and a.hits == 2


async def test_an_upgrade_request_is_answered_over_http11_then_closed() -> None:
    a = Backend("a")
    async with running_backends(a) as urls, running_endpoint(urls) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        # what `curl --http2 http://...` sends: an h2c upgrade the endpoint does not take
        writer.write(post(extra="Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"))
        data = await read_until_closed(reader)
        writer.close()
    assert data.startswith(b"HTTP/1.1 200 OK") and b'"backend": "a"' in data
    assert a.hits == 1 and "upgrade" not in a.seen_headers[0]


class NagleBackend(asyncio.Protocol):
    """A streaming backend as Dynamo 1.6.1's frontend behaves: Nagle's algorithm on (no
    TCP_NODELAY), the answer's head and its first chunk written as two small writes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\r\n\r\n" not in self.buffer:
            return
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        declared = re.search(rb"(?i)content-length: *(\d+)", head)
        length = int(declared.group(1)) if declared else 0
        if len(rest) < length:
            return
        self.buffer = rest[length:]
        if head.startswith(b"GET "):  # the endpoint's health and queue probes
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        loop = asyncio.get_running_loop()
        event = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        # the first token a moment after the head: Nagle holds it until the head is ACKed
        loop.call_later(0.002, self.transport.write, chunk + b"0\r\n\r\n")


@pytest.mark.serial  # times the first chunk of streamed answers on a pooled connection
async def test_a_pooled_connection_acknowledges_a_nagling_backend_at_once() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(NagleBackend, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with (
            running_endpoint([f"http://127.0.0.1:{port}"]) as (url, _),
            httpx.AsyncClient(timeout=10) as c,
        ):
            waits = []
            for _ in range(7):  # one fresh upstream connection, then the pooled one
                started = time.perf_counter()
                async with c.stream(
                    "POST", f"{url}/v1/chat/completions", json={"stream": True}
                ) as r:
                    first = None
                    async for chunk in r.aiter_raw():
                        if first is None and b"data:" in chunk:
                            first = time.perf_counter() - started
                    assert first is not None
                    waits.append(first)
            # Linux's delayed ACK would hold each pooled answer's first chunk for 40 ms
            assert sorted(waits)[len(waits) // 2] < 0.025, waits
    finally:
        server.close()
        await server.wait_closed()


class RecordingSocket:
    """Stands in for a pooled connection's socket: records the options set on it."""

    def __init__(self) -> None:
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.options.append((level, option, value))


def recorded_upstream() -> tuple[UpstreamConnection, RecordingSocket]:
    pool = SimpleNamespace(loop=asyncio.get_running_loop(), forget=lambda conn: None)
    conn = UpstreamConnection(cast(LanePool, pool))
    sock = RecordingSocket()
    conn.sock = cast(socket.socket, sock)
    return conn, sock


@pytest.mark.skipif(QUICKACK is None, reason="TCP_QUICKACK is Linux's")
async def test_an_answer_whole_in_its_first_read_is_not_quick_acked() -> None:
    conn, sock = recorded_upstream()
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    assert conn.complete and b"".join(conn.parts) == b"ok"
    assert sock.options == []  # nothing more is awaited: no system call for it


@pytest.mark.skipif(QUICKACK is None, reason="TCP_QUICKACK is Linux's")
async def test_an_answer_that_goes_on_is_quick_acked_once() -> None:
    conn, sock = recorded_upstream()
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    assert conn.head_done and not conn.complete
    assert sock.options == [(socket.IPPROTO_TCP, QUICKACK, 1)]
    conn.data_received(b"5\r\nhello\r\n0\r\n\r\n")
    assert conn.complete and len(sock.options) == 1


class RecordingTransport:
    """Stands in for a client's transport: records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def streaming_client() -> tuple[ClientConnection, Incoming, RecordingTransport]:
    conn = ClientConnection(cast(Handler, SimpleNamespace()), set())
    transport = RecordingTransport()
    conn.transport = cast(asyncio.Transport, transport)
    req = Incoming()
    req.complete = True
    conn.active = req
    return conn, req, transport


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENTS = [b"data: %d\n\n" % i for i in range(3)]
FRAMES = [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS]
CLIENT_HEAD = SSE_HEAD  # as the data plane frames it again: the same bytes


async def test_a_stream_read_whole_goes_to_the_client_in_one_write() -> None:
    conn, req, transport = streaming_client()
    upstream, _ = recorded_upstream()
    upstream.data_received(SSE_HEAD + b"".join(FRAMES) + b"0\r\n\r\n")
    headers = [(b"content-type", b"text/event-stream")]
    assert await relay(conn, req, upstream, 200, headers, 5.0) == 200
    assert transport.writes == [CLIENT_HEAD + b"".join(FRAMES) + b"0\r\n\r\n"]
    assert req.responded and conn.corked is None


async def test_each_read_of_a_stream_is_one_write_and_nothing_waits() -> None:
    conn, req, transport = streaming_client()
    upstream, _ = recorded_upstream()
    upstream.data_received(SSE_HEAD)
    headers = [(b"content-type", b"text/event-stream")]
    relaying = asyncio.create_task(relay(conn, req, upstream, 200, headers, 5.0))
    await until(lambda: len(transport.writes) == 1)
    assert transport.writes == [CLIENT_HEAD]  # the head goes out before any chunk came
    upstream.data_received(FRAMES[0] + FRAMES[1])
    assert transport.writes[1:] == [FRAMES[0] + FRAMES[1]]  # at once, from the callback
    upstream.data_received(FRAMES[2] + b"0\r\n\r\n")
    assert await relaying == 200
    assert transport.writes[2:] == [FRAMES[2] + b"0\r\n\r\n"]


async def test_what_a_broken_stream_brought_still_goes_out() -> None:
    conn, req, transport = streaming_client()
    upstream, _ = recorded_upstream()
    upstream.data_received(SSE_HEAD + FRAMES[0])
    headers = [(b"content-type", b"text/event-stream")]
    relaying = asyncio.create_task(relay(conn, req, upstream, 200, headers, 5.0))
    await until(lambda: len(transport.writes) == 1)
    upstream.connection_lost(None)
    with pytest.raises(BrokenStream):
        await relaying
    assert transport.writes == [CLIENT_HEAD + FRAMES[0]]
    assert conn.corked is None


async def test_a_pooled_connection_keeps_its_timer_and_a_shorter_timeout_still_holds() -> None:
    conn, _ = recorded_upstream()
    conn.transport = cast(asyncio.Transport, RecordingTransport())
    request, answer = b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    timers = []
    for _ in range(2):
        sending = asyncio.create_task(conn.send(request, b"", 100.0))
        await asyncio.sleep(0)
        conn.data_received(answer)
        await sending
        timers.append(conn.timer)
    assert timers[0] is not None and timers[1] is timers[0]  # one timer for both exchanges
    # a next exchange due before that timer fires gets a timer of its own
    with pytest.raises(TimeoutError, match=r"backend silent for 0\.05 s"):
        async with asyncio.timeout(10):
            await conn.send(request, b"", 0.05)
    assert conn.closed and conn.timer is None
