"""The lanes' circuit breaker: the pure state machine, and a lane that 500s with /health 200."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
from endpoint_helpers import Backend, running_backends, running_endpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgate.runtime.endpoint.breaker import MAX_BACKOFF, Breaker, BreakerState

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


def test_failures_in_a_row_open_it_and_a_success_between_resets_the_count() -> None:
    b = Breaker(failures=3, open_s=10.0)
    for ok in (False, False, True, False, False):
        b.record(ok, 0.0)
    assert b.state is BreakerState.CLOSED and b.admits(0.0)
    b.record(False, 1.0)
    assert b.state is BreakerState.OPEN and b.trips == 1
    assert not b.admits(1.0) and not b.admits(10.9)


def test_after_open_s_one_probe_goes_and_its_outcome_decides() -> None:
    b = Breaker(failures=1, open_s=10.0)
    b.record(False, 0.0)
    assert b.admits(10.0)  # half open: the probe may go
    b.picked(10.0)
    assert b.state is BreakerState.HALF_OPEN and not b.admits(10.5)  # only one probe
    b.record(False, 11.0)  # the probe failed: open again, twice as long
    assert b.state is BreakerState.OPEN and not b.admits(30.9) and b.admits(31.0)
    b.picked(31.0)
    b.record(True, 31.5)
    assert b.state is BreakerState.CLOSED and not b.tripped and b.admits(31.5)


def test_an_abandoned_probe_frees_its_slot_and_an_unsettled_one_expires() -> None:
    b = Breaker(failures=1, open_s=5.0)
    b.record(False, 0.0)
    assert b.admits(5.0)
    b.picked(5.0)
    b.abandoned()
    assert b.admits(5.1)  # the client left: another request may probe
    b.picked(5.1)
    assert not b.admits(10.0) and b.admits(10.1)  # never settled: free again after open_s


def test_zero_failures_turns_it_off() -> None:
    b = Breaker(failures=0)
    for _ in range(100):
        b.record(False, 0.0)
    assert b.state is BreakerState.CLOSED and b.admits(0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 5)), max_size=60))
def test_it_never_keeps_a_lane_out_past_its_longest_backoff(
    steps: list[tuple[bool, float]],
) -> None:
    """Whatever happened before, a lane left alone is admitted again within open_s × backoff."""
    b = Breaker(failures=2, open_s=1.0)
    now = 0.0
    for ok, gap in steps:
        now += gap
        if b.admits(now):
            b.picked(now)
        b.record(ok, now)
        assert b.open_for <= MAX_BACKOFF * b.open_s
    assert b.admits(now + MAX_BACKOFF * b.open_s + 1.0)


async def test_a_lane_that_500s_with_health_200_leaves_rotation_and_a_probe_brings_it_back(
    client: httpx.AsyncClient,
) -> None:
    sick, good = Backend("sick", status=500), Backend("good")
    async with (
        running_backends(sick, good) as urls,
        running_endpoint(urls, breaker_failures=3, breaker_open_s=0.5) as (url, ep),
    ):
        first = [await client.post(f"{url}/v1/completions", json=BODY) for _ in range(8)]
        assert [r.status_code for r in first] == [200] * 8  # each 500 was retried on good
        assert sick.hits == 3 and ep.lanes[0].breaker.tripped  # out after three, not eight
        assert ep.lanes[0].in_rotation  # its health probe still passes
        metrics = (await client.get(f"{url}/metrics")).text
        assert f'slurmgate_backend_breaker_open{{backend="{urls[0]}",endpoint="test"}} 1.0' in (
            metrics
        )
        sick.status = 200  # the engine recovers
        await asyncio.sleep(0.6)
        after = [await client.post(f"{url}/v1/completions", json=BODY) for _ in range(6)]
    assert not ep.lanes[0].breaker.tripped  # the probe passed
    assert Counter(r.json()["backend"] for r in after) == {"sick": 3, "good": 3}


async def test_4xx_answers_never_open_it(client: httpx.AsyncClient) -> None:
    picky, good = Backend("picky", status=400), Backend("good")
    async with (
        running_backends(picky, good) as urls,
        running_endpoint(urls, breaker_failures=2) as (url, ep),
    ):
        rs = [await client.post(f"{url}/v1/completions", json=BODY) for _ in range(8)]
    assert Counter(r.status_code for r in rs) == {400: 4, 200: 4}
    assert not ep.lanes[0].breaker.tripped and ep.lanes[0].breaker.trips == 0
