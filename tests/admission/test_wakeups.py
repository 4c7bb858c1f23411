"""The admission loop's rules: wakes become ticks at once, bursts coalesce, ticks never overlap,
a failing tick does not end the loop, and the interval ticks without events."""

from __future__ import annotations

import asyncio

import pytest

from slurmgate.admission.wakeups import WakeLoop, WakeSettings, WakeSettingsError
from slurmgate.errors import InputError

pytestmark = pytest.mark.serial  # asserts on short wall-clock windows (ticks of 10-200 ms)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_due_times_leading_edge_burst_tail_cap_and_interval() -> None:
    clock = Clock()
    settings = WakeSettings(interval_s=30, min_gap_s=1, quiet_s=0.5, max_delay_s=5)
    loop = WakeLoop(lambda reason: asyncio.sleep(0), settings, clock=clock)
    assert loop.due_at() == 100.0  # the first tick runs at once
    loop._last_start, loop._last_end = 100.0, 100.4
    assert loop.due_at() == 130.0  # nothing pending: the interval
    clock.now = 110.0
    loop.wake("queued")
    assert loop.due_at() == 110.0  # idle and past the gap: at once
    # a wake during a tick: after the tick, once the burst is quiet
    loop._pending_since, loop._last_start, loop._last_end = None, 110.0, 110.0
    clock.now = 110.2
    loop._last_end = 111.0  # the tick ends at 111 (set as the loop would, after it)
    loop.wake("queued")
    clock.now = 110.9
    loop.wake("queued")
    assert loop.due_at() == 111.4  # quiet 0.5 s after the last wake
    # a steady stream moves the tail, but not past max_delay after the first wake
    for step in range(1, 40):
        clock.now = 110.9 + step * 0.2
        loop.wake("queued")
    assert loop.due_at() == pytest.approx(115.2)


def test_a_wake_ticks_at_once_and_a_burst_of_50_makes_two_ticks() -> None:
    ticks: list[str] = []
    running = 0
    most = 0

    async def tick(reason: str) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        ticks.append(reason)
        await asyncio.sleep(0.2)
        running -= 1

    async def main() -> None:
        loop = WakeLoop(tick, WakeSettings(interval_s=None, min_gap_s=0, quiet_s=0.05))
        runner = asyncio.create_task(loop.run())
        await asyncio.sleep(0.3)  # the start tick
        assert ticks == ["start"]
        loop.wake("queued")
        await asyncio.sleep(0.05)
        assert ticks == ["start", "queued"], "a wake while idle must tick at once"
        await asyncio.sleep(0.3)
        # 50 queued events, as one matrix's jobs arrive: the first ticks, the rest wait as one
        for _ in range(50):
            loop.wake("queued")
            await asyncio.sleep(0.001)
        await asyncio.sleep(1.0)
        runner.cancel()
        assert ticks == ["start", "queued", "queued", "queued"], ticks
        assert loop.stats.wakes == 51

    asyncio.run(main())
    assert most == 1, "two ticks overlapped"


def test_wakes_from_many_tasks_never_overlap_ticks() -> None:
    running = 0
    most = 0
    count = 0

    async def tick(reason: str) -> None:
        nonlocal running, most, count
        running += 1
        count += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1

    async def main() -> None:
        loop = WakeLoop(tick, WakeSettings(interval_s=0.05, min_gap_s=0, quiet_s=0))

        async def waker(n: int) -> None:
            for _ in range(30):
                loop.wake(f"w{n}")
                await asyncio.sleep(0.003 * (n + 1))

        runner = asyncio.create_task(loop.run())
        await asyncio.gather(*(waker(n) for n in range(5)))
        await asyncio.sleep(0.1)
        runner.cancel()

    asyncio.run(main())
    assert most == 1
    assert count > 2


def test_a_failing_tick_is_counted_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    async def tick(reason: str) -> None:
        calls.append(reason)
        if len(calls) == 1:
            raise RuntimeError("GitHub said 502")

    async def main() -> WakeLoop:
        loop = WakeLoop(tick, WakeSettings(interval_s=None, min_gap_s=0, quiet_s=0))
        runner = asyncio.create_task(loop.run())
        await asyncio.sleep(0.05)
        loop.wake("queued")
        await asyncio.sleep(0.05)
        runner.cancel()
        return loop

    loop = asyncio.run(main())
    assert calls == ["start", "queued"]
    assert loop.stats.failed == 1 and loop.stats.ticks == 2
    assert "failed; the loop goes on" in caplog.text


def test_the_interval_ticks_without_wakes() -> None:
    async def main() -> WakeLoop:
        loop = WakeLoop(lambda reason: asyncio.sleep(0), WakeSettings(interval_s=0.05))
        await asyncio.wait_for(loop.run(ticks=3), timeout=5)
        return loop

    loop = asyncio.run(main())
    assert loop.stats.reasons == {"start": 1, "interval": 2}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("interval_s", 0, "interval_s=0"),
        ("min_gap_s", -1, "min_gap_s=-1"),
        ("max_delay_s", 0.5, "max_delay_s=0.5"),
    ],
)
def test_bad_timings_name_the_field(field: str, value: float, named: str) -> None:
    with pytest.raises(WakeSettingsError, match=named) as raised:
        WakeSettings(**{field: value})
    assert isinstance(raised.value, InputError)
