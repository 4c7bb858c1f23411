"""Faulty lanes: failing health leaves rotation, hung answers time out, hidden and slow queues."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from endpoint_helpers import (
    Backend,
    Proc,
    running_backends,
    running_endpoint,
    serve_asgi,
    until,
    wait_status,
)

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


def served_by(response: httpx.Response) -> str:
    return str(response.json()["backend"])


async def test_a_lane_whose_health_fails_leaves_rotation_until_it_passes(
    client: httpx.AsyncClient,
) -> None:
    a, b = Backend("a"), Backend("b")
    async with (
        running_backends(a, b) as urls,
        running_endpoint(urls, health_interval=0.05) as (url, ep),
    ):
        a.health_status = 503
        await until(lambda: not ep.lanes[0].in_rotation)
        served = [
            served_by(await client.post(f"{url}/v1/completions", json=BODY)) for _ in range(6)
        ]
        assert served == ["b"] * 6 and a.hits == 0
        metrics = (await client.get(f"{url}/metrics")).text
        assert f'slurmgate_backend_in_rotation{{backend="{urls[0]}",endpoint="test"}} 0.0' in (
            metrics
        )
        a.health_status = 200
        await until(lambda: ep.lanes[0].in_rotation)
        served = [
            served_by(await client.post(f"{url}/v1/completions", json=BODY)) for _ in range(4)
        ]
    assert Counter(served) == {"a": 2, "b": 2}


async def test_requests_waiting_on_a_lane_that_leaves_rotation_are_retried_elsewhere(
    client: httpx.AsyncClient,
) -> None:
    """A wedged engine holds what it was sent: once its probes fail, those move on."""
    wedged, good = Backend("wedged", hang=True), Backend("good")
    async with (
        running_backends(wedged, good) as urls,
        running_endpoint(urls, health_interval=0.05) as (url, ep),
    ):
        stuck = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        await until(lambda: wedged.hits == 1)
        wedged.health_status = 503
        r = await asyncio.wait_for(stuck, 5)
        assert ep.lanes[0].active == 0 and not ep.lanes[0].awaiting
    assert r.status_code == 200 and served_by(r) == "good"
    assert ep.stats.retries == {"unhealthy": 1}


async def test_the_last_lane_in_rotation_keeps_what_it_was_sent(
    client: httpx.AsyncClient,
) -> None:
    slow = Backend("slow", delay=0.6)
    async with (
        running_backends(slow) as urls,
        running_endpoint(urls, health_interval=0.05) as (url, ep),
    ):
        pending = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        await until(lambda: slow.hits == 1)
        slow.health_status = 503
        await until(lambda: not ep.lanes[0].in_rotation)
        r = await pending
    assert r.status_code == 200 and ep.stats.retries == {}


async def test_when_no_lane_passes_its_probes_every_lane_is_tried(
    client: httpx.AsyncClient,
) -> None:
    """Probes that fail everywhere are likelier wrong than every lane dead (panic mode)."""
    a = Backend("a", health_status=503)
    async with (
        running_backends(a) as urls,
        running_endpoint(urls, health_interval=0.05) as (url, ep),
    ):
        await until(lambda: not ep.lanes[0].in_rotation)
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 200 and served_by(r) == "a"


async def test_a_wedged_stub_stops_receiving_requests(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    """A lane hangs every request while its /health says 503: it gets no more of them."""
    wedged = stub("--tokens-per-second", "0", "--wedge-after", "1")
    healthy = stub("--tokens-per-second", "0")
    for lane in (wedged, healthy):
        await wait_status(client, f"{lane.url}/health", 200)
    async with running_endpoint([wedged.url, healthy.url], health_interval=0.1) as (url, ep):
        first = await client.post(f"{url}/v1/completions", json=BODY)
        assert first.status_code == 200  # served by the first lane, which now wedges
        await wait_status(client, f"{wedged.url}/health", 503)
        await until(lambda: not ep.lanes[0].in_rotation, timeout=5)
        started = time.monotonic()
        codes = [
            (await client.post(f"{url}/v1/completions", json=BODY, timeout=5)).status_code
            for _ in range(5)
        ]
    assert codes == [200] * 5
    assert time.monotonic() - started < 4
    assert ep.lanes[0].requests == 1


async def test_a_backend_that_never_answers_is_retried_after_the_first_byte_timeout(
    client: httpx.AsyncClient,
) -> None:
    hung, good = Backend("hung", hang=True), Backend("good")
    async with (
        running_backends(hung, good) as urls,
        running_endpoint(urls, first_byte_timeout=0.5) as (url, ep),
    ):
        started = time.monotonic()
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 200 and served_by(r) == "good"
    assert 0.5 <= time.monotonic() - started < 3
    assert hung.hits == 1 and ep.stats.retries == {"timeout": 1}


async def test_a_stream_may_pause_longer_than_the_first_byte_timeout(
    client: httpx.AsyncClient,
) -> None:
    async def slow_stream(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(2):
            await send(
                {"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True}
            )
            await asyncio.sleep(0.8)  # idle longer than the first-byte timeout
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async with (
        serve_asgi(slow_stream) as backend,
        running_endpoint([backend], first_byte_timeout=0.3) as (url, ep),
    ):
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 200
    assert r.content == b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
    assert ep.stats.broken_streams == 0


async def test_requests_waiting_for_a_pooled_connection_count_as_waiting() -> None:
    """Forty requests, four connections, two may wait: the rest are told 429 at once."""
    slow = Backend("slow", delay=1.0)  # no /metrics at all: the proxy's own queue still counts
    async with (
        running_backends(slow) as urls,
        running_endpoint(urls, pool_size=4, max_waiting=2, retry_after=1) as (url, ep),
        httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=64)) as client,
    ):
        started = time.monotonic()
        rs = await asyncio.gather(
            *(client.post(f"{url}/v1/completions", json=BODY) for _ in range(40))
        )
        elapsed = time.monotonic() - started
    codes = Counter(r.status_code for r in rs)
    # four on the wire and up to three held (a lane takes work while its queue is <= 2)
    assert 4 <= codes[200] <= 7 and codes[429] == 40 - codes[200], codes
    assert all(r.headers["retry-after"] == "1" for r in rs if r.status_code == 429)
    assert slow.hits == codes[200]
    assert elapsed < 6  # nothing waits behind the pool for long
    assert ep.lanes[0].queued == 0 and ep.lanes[0].active == 0


async def test_slow_metrics_of_a_saturated_lane_keep_backpressure_on(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    """A saturated vLLM serves /metrics slowly; a page within --metrics-timeout still counts."""
    lane = stub("--max-concurrency", "1", "--tokens-per-second", "20", "--metrics-delay", "0.3")
    await wait_status(client, f"{lane.url}/health", 200)
    async with running_endpoint(
        [lane.url], max_waiting=0, metrics_timeout=0.5, sample_interval=0.05, retry_after=2
    ) as (url, ep):
        long = {"prompt": "x", "max_tokens": 20}  # 1 s each: one runs, the rest queue
        burst = [
            asyncio.create_task(client.post(f"{url}/v1/completions", json=long, timeout=20))
            for _ in range(3)
        ]
        await until(lambda: not ep.policy.admits(ep.lanes[0], time.monotonic()), timeout=4)
        r = await client.post(f"{url}/v1/completions", json=BODY)
        results = await asyncio.gather(*burst)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert [x.status_code for x in results] == [200, 200, 200]
    assert ep.lanes[0].samples_failed == 0  # every slow page was used


async def test_slow_metrics_alone_do_not_close_an_idle_lane(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "0", "--metrics-delay", "0.4")
    await wait_status(client, f"{lane.url}/health", 200)
    async with running_endpoint(
        [lane.url], max_waiting=0, metrics_timeout=0.2, sample_interval=0.05
    ) as (url, ep):
        await until(lambda: ep.lanes[0].samples_overdue >= 3, timeout=5)
        codes = []
        for _ in range(8):
            codes.append((await client.post(f"{url}/v1/completions", json=BODY)).status_code)
            await asyncio.sleep(0.1)
    assert codes == [200] * 8
