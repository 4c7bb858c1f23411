"""Routing, retries, streaming and header hygiene of the logical endpoint, over loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from endpoint_helpers import (
    Backend,
    refused_url,
    running_backends,
    running_endpoint,
    serve_asgi,
    until,
)

from slurmgate.runtime.endpoint.backpressure import Lane, QueuePolicy
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.heads import HOP_BY_HOP, strip_hop_by_hop
from slurmgate.runtime.endpoint.routing import LeastActiveRouter

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def served_by(response: httpx.Response) -> str:
    return str(response.json()["backend"])


async def test_plain_request_is_proxied_with_body_and_query(client: httpx.AsyncClient) -> None:
    a = Backend("a")
    async with running_backends(a) as urls, running_endpoint(urls) as (url, _):
        r = await client.post(f"{url}/v1/completions?x=1", json=BODY)
    assert r.status_code == 200
    assert served_by(r) == "a"
    assert json.loads(a.seen_bodies[0]) == BODY


async def test_retries_overload_on_another_least_active_backend(client: httpx.AsyncClient) -> None:
    slow, overloaded, free = Backend("slow", delay=0.6), Backend("over", 429), Backend("free")
    async with (
        running_backends(slow, overloaded, free) as urls,
        running_endpoint(urls) as (url, _),
    ):
        first = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        await until(lambda: slow.hits == 1)
        # Cursor now points at "over": it answers 429; of the rest, "free" has fewer in flight.
        r = await client.post(f"{url}/v1/completions", json=BODY)
        assert (await first).status_code == 200
    assert r.status_code == 200
    assert served_by(r) == "free"
    assert (slow.hits, overloaded.hits, free.hits) == (1, 1, 1)


async def test_three_backend_cap_and_final_retry_after_kept(client: httpx.AsyncClient) -> None:
    backends = [Backend(f"b{i}", 429, [(b"retry-after", str(7 + i).encode())]) for i in range(4)]
    async with running_backends(*backends) as urls, running_endpoint(urls) as (url, ep):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 429
    assert [b.hits for b in backends] == [1, 1, 1, 0]
    assert r.headers["retry-after"] == "9"  # the third, final backend's own value
    assert served_by(r) == "b2"
    assert ep.stats.attempts == 3
    assert ep.stats.retries == {"429": 2}


async def test_configured_retry_after_added_when_final_backend_omits_it(
    client: httpx.AsyncClient,
) -> None:
    backends = [Backend("a", 429), Backend("b", 429)]
    async with (
        running_backends(*backends) as urls,
        running_endpoint(urls, retry_after=4) as (url, _),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "4"


async def test_no_retry_after_when_configured_zero(client: httpx.AsyncClient) -> None:
    async with (
        running_backends(Backend("a", 429)) as urls,
        running_endpoint(urls, retry_after=0) as (url, _),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 429
    assert "retry-after" not in r.headers


async def test_earlier_retry_after_kept_when_later_overload_omits_it(
    client: httpx.AsyncClient,
) -> None:
    backends = [Backend("a", 429, [(b"retry-after", b"5")]), Backend("b", 429)]
    async with (
        running_backends(*backends) as urls,
        running_endpoint(urls, retry_after=2) as (url, _),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "5"
    assert [b.hits for b in backends] == [1, 1]


@pytest.mark.parametrize("chunked", [False, True])
async def test_body_over_limit_is_413_and_backend_untouched(
    client: httpx.AsyncClient, chunked: bool
) -> None:
    a = Backend("a")
    payload = b"x" * 5000

    async def chunks() -> Any:
        for i in range(0, len(payload), 1000):
            yield payload[i : i + 1000]

    async with running_backends(a) as urls, running_endpoint(urls, max_body_bytes=4096) as (url, _):
        content: Any = chunks() if chunked else payload
        r = await client.post(f"{url}/v1/completions", content=content)
        ok = await client.post(f"{url}/v1/completions", content=b"y" * 4096)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413
    assert ok.status_code == 200
    assert a.hits == 1 and a.seen_bodies == [b"y" * 4096]


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_transient_5xx_is_retried_on_another_backend(
    client: httpx.AsyncClient, status: int
) -> None:
    bad, good = Backend("bad", status), Backend("good")
    async with running_backends(bad, good) as urls, running_endpoint(urls) as (url, ep):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 200 and served_by(r) == "good"
    assert bad.hits == 1
    assert ep.stats.retries == {str(status): 1}


async def test_non_retryable_status_is_passed_through(client: httpx.AsyncClient) -> None:
    bad, good = Backend("bad", 400), Backend("good")
    async with running_backends(bad, good) as urls, running_endpoint(urls) as (url, _):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 400 and served_by(r) == "bad"
    assert good.hits == 0


async def test_connection_failure_is_retried_on_another_backend(client: httpx.AsyncClient) -> None:
    good = Backend("good")
    async with (
        running_backends(good) as urls,
        # probes far apart: the refused lane stays in rotation until this request tried it
        running_endpoint([refused_url(), *urls], health_interval=60) as (url, ep),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
        metrics = (await client.get(f"{url}/metrics")).text
    assert r.status_code == 200 and served_by(r) == "good"
    assert ep.stats.retries == {"connect": 1}
    assert 'slurmgate_endpoint_retries_total{endpoint="test",reason="connect"} 1.0' in metrics


async def test_overload_then_connection_failure_gives_429(client: httpx.AsyncClient) -> None:
    over = Backend("over", 429, [(b"retry-after", b"3")])
    async with running_backends(over) as urls, running_endpoint([*urls, refused_url()]) as (url, _):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"


async def test_only_connection_failures_give_502(client: httpx.AsyncClient) -> None:
    async with running_endpoint([refused_url(), refused_url()]) as (url, ep):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 502
    assert r.json()["error"]["message"] == "backend unavailable"
    assert ep.stats.attempts == 2


async def test_streaming_arrives_before_the_backend_finishes(client: httpx.AsyncClient) -> None:
    release = asyncio.Event()
    finished = asyncio.Event()

    async def sse(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finished.set()

    async with serve_asgi(sse) as backend, running_endpoint([backend]) as (url, _):
        async with client.stream("POST", f"{url}/v1/completions", json=BODY) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream"
            stream = r.aiter_raw()
            first = await asyncio.wait_for(anext(stream), 5)
            assert first == b"data: first\n\n"
            assert not finished.is_set()  # the backend is still generating
            release.set()
            rest = b"".join([chunk async for chunk in stream])
        assert rest == b"data: [DONE]\n\n"


async def test_no_retry_once_the_response_has_started(client: httpx.AsyncClient) -> None:
    async def breaks(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise RuntimeError("engine died mid-stream")

    spare = Backend("spare")
    async with (
        serve_asgi(breaks) as broken,
        running_backends(spare) as urls,
        running_endpoint([broken, *urls]) as (url, ep),
    ):
        with pytest.raises(httpx.HTTPError):
            async with client.stream("POST", f"{url}/v1/completions", json=BODY) as r:
                async for _ in r.aiter_raw():
                    pass
    assert spare.hits == 0
    assert ep.stats.broken_streams == 1


async def test_health_requires_every_backend(client: httpx.AsyncClient) -> None:
    async with running_backends(Backend("a")) as urls:
        async with running_endpoint([*urls, refused_url()]) as (url, _):
            r = await client.get(f"{url}/health")
            assert r.status_code == 503
            assert r.json() == {"backends_ready": 1, "backends": 2}
        async with running_endpoint(urls) as (url, _):
            r = await client.get(f"{url}/health")
            assert r.status_code == 200
            assert r.json() == {"backends_ready": 1, "backends": 1}


class SlowHealth:
    """A lane whose /health takes 0.5 s to answer (a busy engine's), counting the probes."""

    def __init__(self) -> None:
        self.status = 200
        self.probes = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            self.probes += 1
            await asyncio.sleep(0.5)
        length = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": self.status, "headers": length})
        await send({"type": "http.response.body", "body": b"ok"})


async def test_health_answers_what_the_probes_found_and_a_flood_of_it_reaches_no_lane(
    client: httpx.AsyncClient,
) -> None:
    """GET /health (no token needed) answers from the probes that keep rotation: a flood of it
    sends nothing to the lanes, so it cannot crowd those probes out, and a lane that turns
    unhealthy shows within a probe's interval and time."""
    lane = SlowHealth()
    async with (
        serve_asgi(lane) as lane_url,
        running_endpoint([lane_url], health_interval=0.2) as (url, ep),
    ):
        assert (await client.get(f"{url}/health")).status_code == 200  # the first probe's
        before, started = lane.probes, time.monotonic()
        flood = await asyncio.gather(*(client.get(f"{url}/health") for _ in range(100)))
        took = time.monotonic() - started
        assert [r.status_code for r in flood] == [200] * 100
        # only the periodic probes reached the lane, one at a time, 0.5 s each
        assert lane.probes - before <= took / 0.5 + 2, (lane.probes - before, took)
        assert ep.lanes[0].health_failures == 0
        lane.status = 503
        await until(lambda: ep.lanes[0].health_ok is False, timeout=3)
        got = await client.get(f"{url}/health")
    assert got.status_code == 503
    assert got.json() == {"backends_ready": 0, "backends": 1}


async def test_hop_by_hop_headers_are_stripped_both_ways(client: httpx.AsyncClient) -> None:
    a = Backend(
        "a",
        headers=[
            (b"connection", b"x-private"),
            (b"x-private", b"secret"),
            (b"keep-alive", b"timeout=5"),
            (b"x-public", b"visible"),
        ],
    )
    async with running_backends(a) as urls, running_endpoint(urls) as (url, _):
        r = await client.post(
            f"{url}/v1/completions",
            json=BODY,
            headers={
                "Connection": "keep-alive, X-Nominated",
                "X-Nominated": "drop me",
                "Keep-Alive": "timeout=30",
                "TE": "trailers",
                "Proxy-Authorization": "Basic abc",
                "X-Forwarded-Custom": "keep me",
            },
        )
    seen = a.seen_headers[0]
    assert seen["x-forwarded-custom"] == "keep me"
    for dropped in ("x-nominated", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in seen, dropped
    assert seen["host"] == urls[0].removeprefix("http://")
    assert r.headers["x-public"] == "visible"
    assert "x-private" not in r.headers
    assert "keep-alive" not in r.headers


def test_every_connection_header_nominates_what_is_dropped() -> None:
    headers = [
        (b"X-One", b"1"),
        (b"Connection", b"X-One , ,keep-alive"),
        (b"x-two", b"2"),
        (b"connection", b"X-TWO"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Three", b"3"),
    ]
    assert strip_hop_by_hop(headers, HOP_BY_HOP) == [(b"x-three", b"3")]
    assert strip_hop_by_hop(headers[4:], HOP_BY_HOP) == [(b"x-three", b"3")]
    assert strip_hop_by_hop(headers[5:], frozenset()) == [(b"x-three", b"3")]


async def test_in_flight_count_released_when_client_cancels(client: httpx.AsyncClient) -> None:
    stuck = Backend("stuck", hang=True)
    async with running_backends(stuck) as urls, running_endpoint(urls) as (url, ep):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/v1/completions", json=BODY, timeout=0.5)
        assert stuck.hits == 1
        await until(lambda: ep.lanes[0].active == 0)
        await until(lambda: ep.stats.client_disconnects == 1)
        metrics = (await client.get(f"{url}/metrics")).text
    assert "slurmgate_backend_active" in metrics
    assert 'slurmgate_endpoint_responses_total{endpoint="test",status="499"} 1.0' in metrics


def test_least_active_selection_is_deterministic() -> None:
    lanes = [Lane(index=i, url=f"http://127.0.0.1:{9000 + i}") for i in range(3)]
    router = LeastActiveRouter(lanes, QueuePolicy())
    # All idle: the rotating cursor spreads sequential requests over the lanes in order.
    assert [router.pick(0.0).index for _ in range(4)] == [0, 1, 2, 0]  # type: ignore[union-attr]
    lanes[1].active, lanes[2].active = 2, 1
    # Lane 0 now has 0 in flight, the unique minimum, whatever the cursor says.
    picked = router.pick(0.0)
    assert picked is lanes[0]
    lanes[0].active = 1
    # Tie between lanes 0 and 2 (1 each): the scan starts after the last pick (lane 0) → lane 2.
    assert router.pick(0.0) is lanes[2]
    assert router.pick(0.0) is lanes[0]
    assert router.pick(0.0, exclude=[lanes[0], lanes[2]]) is lanes[1]
    assert router.pick(0.0, exclude=lanes) is None


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        EndpointConfig(name="d", backends=["127.0.0.1:8000"])
    with pytest.raises(ValueError, match="listed twice"):
        EndpointConfig(name="d", backends=["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="max_waiting"):
        EndpointConfig(name="d", backends=["http://a:1"], max_waiting=-1)
    with pytest.raises(ValueError, match="extra"):
        EndpointConfig(name="d", backends=["http://a:1"], max_wating=3)  # type: ignore[call-arg]


async def test_upstream_connections_are_pooled_and_reused(client: httpx.AsyncClient) -> None:
    a = Backend("a")
    async with running_backends(a) as urls, running_endpoint(urls) as (url, _):
        for _ in range(5):
            assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
    assert a.hits == 5
    assert len(a.client_ports) == 1  # one keep-alive connection served all five


async def test_waiting_for_a_pooled_connection_is_not_a_connect_timeout(
    client: httpx.AsyncClient,
) -> None:
    a = Backend("a", delay=0.3)
    async with (
        running_backends(a) as urls,
        running_endpoint(urls, pool_size=1, connect_timeout=0.1) as (url, ep),
    ):
        rs = await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=BODY) for _ in range(3))
        )
    assert [r.status_code for r in rs] == [200, 200, 200]
    assert ep.stats.retries == {}
    assert a.hits == 3 and len(a.client_ports) == 1


async def test_an_answer_cut_before_relay_is_not_retried(client: httpx.AsyncClient) -> None:
    """The lane took the request and broke mid-answer: it may be the request that broke it."""

    async def cuts(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await receive()
        headers = [(b"content-length", b"100")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        raise RuntimeError("engine died after one byte")

    good = Backend("good")
    async with (
        serve_asgi(cuts) as broken,
        running_backends(good) as urls,
        running_endpoint([broken, *urls]) as (url, ep),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 502 and "not retried" in r.json()["error"]["message"]
    assert good.hits == 0 and ep.stats.retries == {}


async def test_a_request_that_kills_its_lane_is_not_sent_to_the_next(
    client: httpx.AsyncClient,
) -> None:
    """A lane reads the whole request and dies (its connection closes, no answer): 502, and
    the other replicas never see the request."""
    seen: list[bytes] = []

    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        seen.append(await reader.readexactly(length))
        writer.transport.abort()  # as a crashed engine's sockets: reset, no answer

    good = Backend("good")
    server = await asyncio.start_server(dies, "127.0.0.1", 0)
    killer = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with (
        server,
        running_backends(good) as urls,
        # probes far apart: the dying lane stays in rotation, so it is picked first
        running_endpoint([killer, *urls], health_interval=60) as (url, ep),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 502, r.text
    assert len(seen) == 1 and good.hits == 0
    assert ep.stats.attempts == 1 and ep.stats.retries == {}
