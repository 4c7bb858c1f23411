"""Per-lane queue backpressure: depth parsing, fail-open, sampler recovery, 429 on overload."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from endpoint_helpers import (
    FAST,
    Backend,
    Proc,
    refused_url,
    running_backends,
    running_endpoint,
    until,
    wait_status,
    waiting_metrics,
)

from slurmgate.runtime.endpoint.backpressure import Lane, QueuePolicy, Sampler, queue_depth

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


def test_queue_depth_sums_every_sample_and_both_spellings() -> None:
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m",engine="1"} 3.0\n'
        'vllm:num_requests_running{model_name="m"} 8.0\n'
    )
    assert queue_depth(text) == 5.0  # summed, not overwritten by the last sample
    underscore = (
        'vllm_num_requests_waiting{engine="0"} 1\nvllm_num_requests_waiting{engine="1"} 4\n'
    )
    assert queue_depth(underscore) == 5.0
    assert queue_depth('vllm:num_requests_running{model_name="m"} 1\n') is None
    assert queue_depth("vllm:num_requests_waiting NaN\nvllm:num_requests_waiting -3\n") == 0.0


def test_policy_fails_open_on_missing_or_stale_samples_and_counts_in_flight() -> None:
    policy = QueuePolicy(max_waiting=2, stale_after=1.0)
    lane = Lane(index=0, url="http://127.0.0.1:1")
    assert policy.admits(lane, 10.0)  # never sampled
    lane.record_sample(3.0, taken_at=10.0, active_then=0)
    assert not policy.admits(lane, 10.5)
    assert policy.admits(lane, 11.01)  # older than stale_after: fail-open
    lane.record_sample(1.0, taken_at=20.0, active_then=4)
    assert policy.admits(lane, 20.1)
    lane.active = 6  # two more routed since the sample, and the backend was already queueing
    assert policy.estimated_depth(lane, 20.1) == 3.0
    assert not policy.admits(lane, 20.1)
    lane.active = 3  # completions since the sample shortened the queue
    assert policy.estimated_depth(lane, 20.1) == 0.0
    lane.record_sample(0.0, taken_at=30.0, active_then=0)
    lane.active = 5  # backend had free slots at the sample: no guess, the next sample decides
    assert policy.estimated_depth(lane, 30.05) == 0.0
    lane.record_sample(None, taken_at=40.0, active_then=0)
    assert policy.estimated_depth(lane, 40.0) is None


def test_a_learned_capacity_bounds_a_burst_between_samples() -> None:
    """Once a queue showed the lane's capacity, a burst after an idle sample cannot overshoot."""
    policy = QueuePolicy(max_waiting=0, stale_after=1.0)
    lane = Lane(index=0, url="http://127.0.0.1:1")
    lane.record_sample(0.0, taken_at=1.0, active_then=0, running=0.0)
    lane.active = 9  # a burst before the lane ever queued: capacity unknown, so no guess
    assert policy.estimated_depth(lane, 1.05) == 0.0
    lane.record_sample(3.0, taken_at=2.0, active_then=5, running=2.0)  # saturated at 2 running
    assert lane.capacity == 2.0
    lane.record_sample(0.0, taken_at=3.0, active_then=1, running=1.0)  # idle again: 1 slot free
    lane.active = 2  # one more routed: fits the free slot
    assert policy.estimated_depth(lane, 3.05) == 0.0 and policy.admits(lane, 3.05)
    lane.active = 5  # a burst of four: three of them would wait
    assert policy.estimated_depth(lane, 3.05) == 3.0 and not policy.admits(lane, 3.05)


def test_queue_sample_reads_waiting_and_running_summed() -> None:
    from slurmgate.runtime.endpoint.backpressure import queue_sample

    text = (
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 1\n'
        'vllm:num_requests_running{engine="0"} 4\nvllm:num_requests_running{engine="1"} 4\n'
    )
    assert queue_sample(text) == (3.0, 8.0)
    assert queue_sample("vllm_num_requests_running 2\n") == (None, 2.0)


async def test_every_lane_over_limit_gives_429_while_health_and_metrics_answer(
    client: httpx.AsyncClient,
) -> None:
    a = Backend("a", metrics=waiting_metrics(5))
    b = Backend("b", metrics=waiting_metrics(3))
    async with (
        running_backends(a, b) as urls,
        running_endpoint(urls, max_waiting=2, retry_after=3) as (url, ep),
    ):
        await until(lambda: all(lane.depth is not None for lane in ep.lanes))
        r = await client.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", 429)
        assert (await client.get(f"{url}/health")).status_code == 200
        metrics = (await client.get(f"{url}/metrics")).text
        assert 'slurmgate_endpoint_overload_rejections_total{endpoint="test"} 1.0' in metrics
        # One lane drains below the limit: it alone takes the next request.
        b.metrics = waiting_metrics(1)
        await until(lambda: ep.lanes[1].depth == 1.0)
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["backend"] == "b"
    assert a.hits == 0


async def test_missing_metric_fails_open(client: httpx.AsyncClient) -> None:
    no_metric = Backend("a", metrics="# nothing from vllm here\nprocess_cpu_seconds_total 1.0\n")
    no_endpoint = Backend("b", metrics=None)  # /metrics answers 404
    async with (
        running_backends(no_metric, no_endpoint) as urls,
        running_endpoint(urls, max_waiting=0) as (url, ep),
    ):
        await until(lambda: ep.lanes[0].samples_ok > 0 and ep.lanes[1].samples_failed > 0)
        codes = [
            (await client.post(f"{url}/v1/completions", json=BODY)).status_code for _ in range(4)
        ]
    assert codes == [200] * 4
    assert ep.lanes[0].last_error == "metric missing"
    assert "404" in (ep.lanes[1].last_error or "")


async def test_sampler_error_then_recovery_restores_the_limit(client: httpx.AsyncClient) -> None:
    """The seed review's bug: a reader error must not kill the sampler."""
    a = Backend("a", metrics=waiting_metrics(4))
    async with running_backends(a) as urls, running_endpoint(urls, max_waiting=1) as (url, ep):
        lane = ep.lanes[0]
        await until(lambda: lane.depth == 4.0)
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 429
        a.metrics_status = 500  # scrape fails → fail-open
        failed = lane.samples_failed
        await until(lambda: lane.samples_failed > failed)
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
        a.metrics_status, a.metrics = (
            200,
            "vllm:num_requests_waiting{{{ 4",
        )  # unparsable → fail-open
        failed = lane.samples_failed
        await until(lambda: lane.samples_failed > failed)
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
        a.metrics = waiting_metrics(4)  # the next good sample restores the limit
        await until(lambda: lane.depth == 4.0)
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 429
    assert a.hits == 2


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
async def test_sampler_does_not_swallow_process_control(exc: type[BaseException]) -> None:
    async def read(lane: Lane) -> str:
        raise exc()

    sampler = Sampler(Lane(index=0, url="http://x:1"), read, interval=0.01, timeout=0.5)
    with pytest.raises(exc):
        await sampler.run()


async def test_sampler_stops_on_cancel_even_if_the_reader_rewraps_it() -> None:
    started = asyncio.Event()

    async def read(lane: Lane) -> str:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise OSError("client library turned the cancel into its own error") from None
        return ""

    task = asyncio.create_task(Sampler(Lane(0, "http://x:1"), read, 0.01, 5.0).run())
    await started.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    assert done and task.cancelled()


async def test_lanes_are_scraped_concurrently_not_in_turn() -> None:
    async def slow(lane: Lane) -> str:
        await asyncio.sleep(0.15)
        return waiting_metrics(1)

    async def fast(lane: Lane) -> str:
        return waiting_metrics(2)

    slow_lane, fast_lane = Lane(0, "http://slow:1"), Lane(1, "http://fast:1")
    samplers = [Sampler(slow_lane, slow, 0.02, 0.5), Sampler(fast_lane, fast, 0.02, 0.5)]
    tasks = [asyncio.create_task(s.run()) for s in samplers]
    await asyncio.sleep(0.5)
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    assert fast_lane.depth == 2.0 and slow_lane.depth == 1.0
    assert fast_lane.samples_ok >= 3 * slow_lane.samples_ok


async def test_a_hung_scrape_is_abandoned_and_its_stale_sample_fails_open() -> None:
    async def hangs(lane: Lane) -> str:
        await asyncio.sleep(5)
        return ""

    policy = QueuePolicy(max_waiting=2, stale_after=0.3)
    lane = Lane(0, "http://x:1")
    lane.record_sample(9.0, time.monotonic(), 0)
    started = time.monotonic()
    await Sampler(lane, hangs, interval=0.05, timeout=0.1).sample_once()
    assert 0.1 <= time.monotonic() - started < 0.5  # abandoned at its timeout
    assert lane.samples_overdue == lane.samples_failed == 1
    assert lane.last_error == "metrics scrape timed out after 0.1 s"
    # A slow page is a sign of a busy lane: the last sample counts while it is fresh ...
    assert policy.estimated_depth(lane, lane.sampled_at + 0.2) == 9.0
    assert not policy.admits(lane, lane.sampled_at + 0.2)
    # ... and once it is stale the queue is unknown: the lane takes work (fail-open).
    stale = lane.sampled_at + 0.31
    assert policy.queue_unknown(lane, stale) and policy.estimated_depth(lane, stale) is None
    assert policy.admits(lane, stale)
    lane.active = lane.queued = 3  # requests held here for a connection are still known
    assert policy.estimated_depth(lane, stale) == 3.0 and not policy.admits(lane, stale)


async def test_a_slow_page_within_the_timeout_is_used_and_stamped_when_it_came() -> None:
    async def late(lane: Lane) -> str:
        lane.active += 1  # sent while the page was on its way: the late page counts it
        await asyncio.sleep(0.15)
        return waiting_metrics(2)

    lane = Lane(0, "http://x:1")
    asked = time.monotonic()
    await Sampler(lane, late, interval=0.05, timeout=0.5).sample_once()
    assert lane.depth == 2.0 and lane.samples_failed == 0
    assert lane.sampled_at >= asked + 0.15 and lane.active_at_sample == 1


async def test_real_overload_of_a_stub_gives_429_with_retry_after(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--max-concurrency", "1", "--tokens-per-second", "20")
    await wait_status(client, f"{lane.url}/health", 200)
    async with running_endpoint([lane.url], max_waiting=0, retry_after=2) as (url, ep):
        long = {"prompt": "x", "max_tokens": 10}  # 0.5 s each at 20 tokens/s
        burst = [
            asyncio.create_task(client.post(f"{url}/v1/completions", json=long)) for _ in range(3)
        ]
        await until(lambda: (ep.lanes[0].depth or 0) > 0, timeout=3)
        r = await client.post(f"{url}/v1/completions", json=BODY)
        health = await client.get(f"{url}/health")
        results = await asyncio.gather(*burst)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert health.status_code == 200
    assert [x.status_code for x in results] == [200, 200, 200]


async def test_connection_failure_then_only_full_lanes_gives_429(client: httpx.AsyncClient) -> None:
    full = Backend("full", metrics=waiting_metrics(9))
    async with (
        running_backends(full) as urls,
        running_endpoint([refused_url(), *urls], max_waiting=2, retry_after=5) as (url, ep),
    ):
        await until(lambda: ep.lanes[1].depth == 9.0)
        r = await client.post(f"{url}/v1/completions", json=BODY)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "5"
    assert full.hits == 0


async def test_backend_cookies_are_not_kept_between_clients(client: httpx.AsyncClient) -> None:
    setter = Backend("a", headers=[(b"set-cookie", b"session=alice; Path=/")])
    async with running_backends(setter) as urls:
        # By host name: a cookie jar would refuse cookies from a bare IP and hide the leak.
        by_name = [u.replace("127.0.0.1", "localhost") for u in urls]
        async with (
            running_endpoint(by_name) as (url, _),
            httpx.AsyncClient() as alice,
            httpx.AsyncClient() as bob,
        ):
            first = await alice.post(f"{url}/v1/completions", json=BODY)
            await bob.post(f"{url}/v1/completions", json=BODY)
    assert first.headers["set-cookie"] == "session=alice; Path=/"  # relayed to its client
    assert "cookie" not in setter.seen_headers[1]  # but never replayed for another


async def test_sampling_continues_when_the_proxy_pool_is_full(client: httpx.AsyncClient) -> None:
    a = Backend("a", hang=True, metrics=waiting_metrics(0))
    async with (
        running_backends(a) as urls,
        running_endpoint(urls, pool_size=1, max_waiting=3) as (url, ep),
    ):
        stuck = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        await until(lambda: a.hits == 1)  # the only pooled upstream connection is now busy
        a.metrics = waiting_metrics(7)
        await until(lambda: ep.lanes[0].depth == 7.0)  # scrapes still get through
        assert (await client.get(f"{url}/health")).status_code == 200
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 429
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)


def test_queue_depth_reads_a_full_vllm_sized_page() -> None:
    noise = []
    for family in range(40):
        noise.append(
            f"# HELP vllm:latency_{family} seconds\n# TYPE vllm:latency_{family} histogram"
        )
        for bucket in [*(f"{0.001 * 2**i:g}" for i in range(30)), "+Inf"]:
            noise.append(f'vllm:latency_{family}_bucket{{le="{bucket}",engine="0"}} 12.0')
        noise.append(f'vllm:latency_{family}_count{{engine="0"}} 12.0')
    page = (
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        + "\n".join(noise[:700])
        + '\nvllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n'
        + "\n".join(noise[700:])
        + "\n# TYPE vllm:num_requests_waiting gauge\n"
        + 'vllm:num_requests_waiting{model_name="m",engine="1"} 5.0\n'
    )
    assert len(page) > 50_000
    assert queue_depth(page) == 7.0


async def test_samples_a_real_prometheus_client_server() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, make_asgi_app

    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=registry)
    waiting.labels("m").set(6)
    Counter("vllm:prompt_tokens", "noise", registry=registry).inc(100)
    async with (
        running_backends(make_asgi_app(registry)) as urls,
        running_endpoint(urls, max_waiting=5) as (_, ep),
    ):
        await until(lambda: ep.lanes[0].depth == 6.0)
        waiting.labels("m").set(1)
        await until(lambda: ep.lanes[0].depth == 1.0)
    assert ep.lanes[0].samples_failed == 0


# Short periods so a test sees many of them in a few seconds; the same proportions as the
# defaults: a scrape timeout plus one interval stays under the staleness bound.


async def post_status(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json=BODY)


async def until_status(
    client: httpx.AsyncClient, url: str, status: int, timeout: float = 3.0
) -> tuple[httpx.Response, float]:
    """Post until the endpoint answers status; the answer and the seconds it took."""
    started = time.monotonic()
    while True:
        r = await post_status(client, url)
        waited = time.monotonic() - started
        if r.status_code == status:
            return r, waited
        assert waited < timeout, f"still {r.status_code} after {waited:.2f}s, not {status}"
        await asyncio.sleep(0.01)


def backend_value(metrics_text: str, name: str, backend: str) -> float:
    """One lane's value of a slurmgate_backend_* family in the endpoint's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("backend") == backend:
                return float(sample.value)
    raise AssertionError(f"{name} of {backend} is not in /metrics")


@pytest.mark.serial  # times how soon the lane fails open, then how long it stays open
async def test_a_hung_metrics_page_fails_open_for_many_sampling_periods(
    client: httpx.AsyncClient,
) -> None:
    a = Backend("a", metrics=waiting_metrics(9))
    async with (
        running_backends(a) as urls,
        running_endpoint(urls, max_waiting=2, retry_after=3, **FAST) as (url, ep),
    ):
        lane = ep.lanes[0]
        await until(lambda: lane.depth == 9.0)
        assert (await post_status(client, url)).status_code == 429
        a.metrics_hang = True  # takes the scrape's request and never answers
        # the last sample counts until it is stale_after old; then the queue is unknown
        _, waited = await until_status(client, url, 200)
        assert waited < FAST["stale_after"] + 0.5
        codes: list[int] = []
        hold_until = time.monotonic() + 40 * FAST["sample_interval"]
        while time.monotonic() < hold_until:
            codes.append((await post_status(client, url)).status_code)
            await asyncio.sleep(0.02)
        text = (await client.get(f"{url}/metrics")).text
    assert len(codes) >= 10 and set(codes) == {200}, codes
    # each hung scrape was abandoned at its timeout and the next one made: sampling went on
    assert lane.samples_overdue >= 5
    assert "timed out" in (lane.last_error or "")
    assert lane.in_rotation  # a hung /metrics is not a failed health probe
    assert backend_value(text, "slurmgate_backend_sample_failed_open", urls[0]) == 1.0
    assert backend_value(text, "slurmgate_backend_open", urls[0]) == 1.0


@pytest.mark.serial  # bounds how soon the limit comes back with the metrics
async def test_metrics_back_over_then_under_the_limit_bring_429_then_200_back(
    client: httpx.AsyncClient,
) -> None:
    a = Backend("a", metrics=waiting_metrics(9), metrics_hang=True)  # hung from the start
    async with (
        running_backends(a) as urls,
        running_endpoint(urls, max_waiting=2, retry_after=3, **FAST) as (url, ep),
    ):
        lane = ep.lanes[0]
        await asyncio.sleep(2 * FAST["stale_after"])  # no sample ever, for twice the bound
        hung = [(await post_status(client, url)).status_code for _ in range(5)]
        hung_text = (await client.get(f"{url}/metrics")).text
        a.metrics_hang = False  # the page is back, and shows a queue over the limit
        over, back_in = await until_status(client, url, 429)
        over_text = (await client.get(f"{url}/metrics")).text
        a.metrics = waiting_metrics(1)  # the queue drained under the limit
        _, served_in = await until_status(client, url, 200)
    assert hung == [200] * 5
    assert backend_value(hung_text, "slurmgate_backend_sample_failed_open", urls[0]) == 1.0
    # at most the hung scrape's timeout and one interval, plus room for a busy machine
    assert back_in < FAST["metrics_timeout"] + FAST["sample_interval"] + 0.75
    assert over.headers["retry-after"] == "3"
    assert over.json()["error"]["type"] == "rate_limit_exceeded"
    assert backend_value(over_text, "slurmgate_backend_sample_failed_open", urls[0]) == 0.0
    assert served_in < FAST["sample_interval"] + 0.75
    assert lane.depth == 1.0


async def test_an_oversized_or_garbage_metrics_page_fails_open_and_sampling_goes_on(
    client: httpx.AsyncClient,
) -> None:
    # over the default --max-metrics-bytes (1 MiB), with a queue over the limit at its top
    padding = "# " + "x" * 1000 + "\n"
    a = Backend("a", metrics=waiting_metrics(9) + padding * 1100)
    async with (
        running_backends(a) as urls,
        running_endpoint(urls, max_waiting=2, **FAST) as (url, ep),
    ):
        lane = ep.lanes[0]
        await until(lambda: "declares" in (lane.last_error or ""))  # its Content-Length
        declared = (await post_status(client, url)).status_code
        a.metrics_chunk = 64 * 1024  # the same page streamed with no length: cut at the bound
        await until(lambda: "more than" in (lane.last_error or ""))
        streamed = (await post_status(client, url)).status_code
        a.metrics, a.metrics_chunk = "vllm:num_requests_waiting{{{ 9\n", 0  # unparsable
        await until(lambda: "ValueError" in (lane.last_error or ""))
        garbage = (await post_status(client, url)).status_code
        a.metrics = waiting_metrics(9)  # the sampler is still running: the limit comes back
        await until(lambda: lane.depth == 9.0)
        over = (await post_status(client, url)).status_code
    assert (declared, streamed, garbage, over) == (200, 200, 200, 429)
    assert lane.samples_failed >= 3
