"""The load generator against real loopback servers: counts, percentiles and Retry-After."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from endpoint_helpers import Backend, Proc, running_backends, wait_status

from slurmgate.runtime.loadgen.completions import LoadSpec, run_load
from slurmgate.runtime.loadgen.report import percentile
from slurmgate.runtime.loadgen.workload import retry_after_seconds


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 1) == 3.0


def test_spec_must_end() -> None:
    with pytest.raises(ValueError, match="duration or requests"):
        LoadSpec(url="http://x", duration=None, requests=None).check()


async def test_counts_and_latency_against_a_stub(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "0", "--first-token-delay", "0.02")
    await wait_status(client, f"{lane.url}/health", 200)
    report = await run_load(LoadSpec(url=lane.url, concurrency=4, duration=None, requests=40))
    assert (report.sent, report.ok, report.throttled, report.errors) == (40, 40, 0, {})
    assert 0.02 <= report.latency_p50 <= report.latency_p99 < 1.0
    assert report.throughput > 0


async def test_honours_retry_after_on_429() -> None:
    busy = Backend("busy", 429, [(b"retry-after", b"1")])
    async with running_backends(busy) as urls:
        polite = await run_load(LoadSpec(url=urls[0], concurrency=1, duration=1.5))
        pushy = await run_load(
            LoadSpec(url=urls[0], concurrency=1, duration=0.5, honour_retry_after=False)
        )
    assert polite.ok == 0
    assert polite.throttled == 2  # at 0 s and at 1 s, then the run ends while waiting
    assert polite.retry_after_waited >= 1.0
    assert pushy.throttled > 20


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds("0.5") == 0.5
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert retry_after_seconds("Tue, 14 Nov 2023 22:13:25 GMT", now=now) == 5.0
    assert retry_after_seconds("Tue, 14 Nov 2023 22:13:00 GMT", now=now) == 0.0
    assert retry_after_seconds("soon") == 0.0


async def test_streamed_requests_report_time_to_first_byte(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "20")
    await wait_status(client, f"{lane.url}/health", 200)
    body = {"prompt": "a", "max_tokens": 6, "stream": True}  # 6 tokens at 20/s: 0.3 s
    report = await run_load(
        LoadSpec(url=lane.url, concurrency=2, duration=None, requests=4, body=body)
    )
    assert report.ok == 4
    assert report.first_byte_p50 < report.latency_p50 - 0.15
    assert report.latency_p50 >= 0.3
