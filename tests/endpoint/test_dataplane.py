"""The endpoint's data plane speaks HTTP/1.1 to clients and lanes: raw exchanges over loopback."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
from endpoint_helpers import Backend, running_backends, running_endpoint, serve_asgi, until

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

    async with serve_asgi(firehose) as backend, running_endpoint([backend]) as (url, _):
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
