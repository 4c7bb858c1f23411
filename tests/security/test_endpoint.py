"""The logical endpoint facing hostile clients: odd targets, huge bodies, missing credentials.

The endpoint runs for real under uvicorn, in this event loop or as `python -m
slurmgate.runtime.endpoint` in a subprocess when its memory is measured; backends are small
ASGI apps on loopback that record what reaches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
import pytest
from endpoint_helpers import (
    Backend,
    endpoint_process,
    peak_rss_mib,
    running_backends,
    running_endpoint,
    serve_asgi,
)
from pydantic import SecretStr

from slurmgate.runtime.endpoint.config import TOKEN_ENV, EndpointConfig, parse_config

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}
TOKEN = "s3cret-endpoint-token"


async def raw_exchange(url: str, request: bytes, *, then: bytes = b"", wait: float = 3.0) -> bytes:
    """Send raw bytes over one connection and return what came back within ``wait`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await asyncio.wait_for(reader.readexactly(length), wait)
        if then:
            with contextlib.suppress(OSError):
                writer.write(then)
        return head + body
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("shape", "answer"),
    [
        # the parser refuses an authority glued to a path; the endpoint refuses any target that
        # is not a path (an asterisk here), and reduces an absolute URL to its path (RFC 9112)
        ("@{evil}/v1/completions", b"Invalid HTTP request"),
        ("*", b"must be a path starting with /"),
        ("http://{evil}/v1/completions", b'"backend": "lane"'),
    ],
)
async def test_a_target_naming_another_host_never_reaches_it(shape: str, answer: bytes) -> None:
    lane, evil = Backend("lane"), Backend("evil")
    async with (
        running_backends(lane, evil) as (lane_url, evil_url),
        running_endpoint([lane_url]) as (url, _),
    ):
        target = shape.format(evil=evil_url.removeprefix("http://"))
        request = (
            f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 2\r\nConnection: close\r\n\r\n{}"
        ).encode()
        response = await raw_exchange(url, request)
    assert answer in response
    assert status_of(response) == (200 if b"lane" in answer else 400)
    assert evil.hits == 0
    assert lane.hits == (1 if b"lane" in answer else 0)


async def test_a_chunked_body_over_the_limit_is_refused_at_its_first_chunk() -> None:
    """The client sends one chunk past the limit and then waits: the 413 must not wait too."""
    lane = Backend("lane")
    async with (
        running_backends(lane) as urls,
        running_endpoint(urls, max_body_bytes=4096) as (url, ep),
    ):
        chunk = b"x" * 5000
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(chunk)
            + chunk
            + b"\r\n"
        )
        started = time.monotonic()
        response = await raw_exchange(url, request, wait=3.0)
    assert status_of(response) == 413
    assert time.monotonic() - started < 2
    assert lane.hits == 0 and ep.stats.rejected_too_large == 1


async def test_a_request_head_over_64_kib_is_refused() -> None:
    lane = Backend("lane")
    async with running_backends(lane) as urls, running_endpoint(urls) as (url, _):
        request = (
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(70))
            + b"\r\n"
        )
        response = await raw_exchange(url, request)
    assert status_of(response) == 431
    assert lane.hits == 0


@pytest.mark.serial
async def test_a_head_that_never_ends_loses_its_connection() -> None:
    """A slowloris client trickles a head and never finishes it: the endpoint hangs up."""
    async with running_backends(Backend("lane")) as urls, running_endpoint(urls) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for _ in range(30):  # a header line every half second, never the blank line
            writer.write(b"X-Slow: 1\r\n")
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(reader.read(1024), 0.5) == b"":
                    break
        closed_after = time.monotonic() - started
        writer.close()
    assert 9 <= closed_after < 14, closed_after


async def test_the_bearer_token_guards_everything_but_get_health() -> None:
    lane = Backend("lane")
    async with (
        running_backends(lane) as urls,
        running_endpoint(urls, token=SecretStr(TOKEN)) as (url, ep),
        httpx.AsyncClient(timeout=10) as client,
    ):
        good = {"Authorization": f"Bearer {TOKEN}"}
        missing = await client.post(f"{url}/v1/completions", json=BODY)
        wrong = await client.post(
            f"{url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {TOKEN}x"}
        )
        basic = await client.post(
            f"{url}/v1/completions", json=BODY, headers={"Authorization": TOKEN}
        )
        models = await client.get(f"{url}/v1/models")
        metrics = await client.get(f"{url}/metrics")
        health = await client.get(f"{url}/health")
        served = await client.post(f"{url}/v1/completions", json=BODY, headers=good)
        lower_scheme = await client.post(
            f"{url}/v1/completions", json=BODY, headers={"Authorization": f"bearer {TOKEN}"}
        )
        metrics_ok = await client.get(f"{url}/metrics", headers=good)
    for refused in (missing, wrong, basic, models, metrics):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert b"\n" not in refused.content.strip()  # one line of JSON
        assert refused.json()["error"]["code"] == 401
        assert TOKEN not in refused.text
    assert health.status_code == 200
    assert served.status_code == 200 and metrics_ok.status_code == 200
    assert lower_scheme.status_code == 200
    assert lane.hits == 2  # nothing unauthenticated reached the lane
    # The endpoint's credential is its own: the lane never sees it.
    assert "authorization" not in lane.seen_headers[0]
    assert ep.stats.rejected_unauthorized == 5


def test_the_token_comes_from_the_environment_and_never_from_or_into_argv() -> None:
    argv = ["--name", "d", "--listen", "127.0.0.1:0", "--backend", "http://a:1"]
    config = parse_config(argv, environ={TOKEN_ENV: TOKEN})
    assert config.token is not None and config.token.get_secret_value() == TOKEN
    assert TOKEN not in " ".join(config.argv()) and TOKEN not in repr(config)
    assert parse_config(argv, environ={TOKEN_ENV: ""}).token is None
    assert parse_config(argv, environ={}).token is None
    assert EndpointConfig(name="d", backends=["http://a:1"], token=SecretStr("")).token is None
    with pytest.raises(SystemExit):
        parse_config([*argv, "--token", TOKEN], environ={})


async def test_the_endpoint_process_takes_its_token_from_the_environment() -> None:
    async with (
        running_backends(Backend("lane")) as (lane_url,),
        endpoint_process(lane_url, env={TOKEN_ENV: TOKEN}) as (url, proc),
        httpx.AsyncClient(timeout=10) as client,
    ):
        refused = await client.post(f"{url}/v1/completions", json=BODY)
        served = await client.post(
            f"{url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with open(f"/proc/{proc.pid}/cmdline", "rb") as cmdline:
            assert TOKEN.encode() not in cmdline.read()
    assert refused.status_code == 401 and served.status_code == 200


async def _sink(scope: Any, receive: Any, send: Any) -> None:
    """A backend that reads and drops bodies, and answers a second later (bodies pile up)."""
    if scope["type"] != "http":
        return
    if scope["path"] in ("/health", "/metrics"):
        status = 200 if scope["path"] == "/health" else 404
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await asyncio.sleep(1.0)
    body = json.dumps({"received": size}).encode()
    headers = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def test_large_bodies_stay_within_the_buffer_budget() -> None:
    """Six 40 MB bodies at once: the endpoint holds at most its budget, and refuses the rest."""
    mib = 1024 * 1024
    size, budget = 40 * mib, 96 * mib
    payload = b"x" * size
    async with (
        serve_asgi(_sink) as backend,
        endpoint_process(
            backend, "--max-body-bytes", str(48 * mib), "--max-buffered-bytes", str(budget)
        ) as (url, proc),
        httpx.AsyncClient(timeout=60) as client,
    ):
        before = peak_rss_mib(proc.pid)
        rs = await asyncio.gather(
            *(client.post(f"{url}/v1/completions", content=payload) for _ in range(6))
        )
        grown = peak_rss_mib(proc.pid) - before
    codes = sorted(r.status_code for r in rs)
    # The budget counts what arrived: six uploads side by side each hold part of it until one
    # no longer fits and is refused; at least the two a budget holds whole get through.
    assert set(codes) <= {200, 429} and codes.count(200) >= 2, codes
    assert all(r.json()["received"] == size for r in rs if r.status_code == 200)
    # Each body is held once (it was held about three times before).
    assert grown < budget / mib + 40, f"peak RSS grew {grown:.0f} MiB"
