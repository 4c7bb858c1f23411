"""Wake-ups into ticks: one tick running, at most one pending, spaced by a gap, an interval floor.

The admission loop (`flows/admission_loop.py`) calls `WakeLoop.wake` for every GitHub event
that may change what can be admitted, and `WakeLoop.run` turns them into ticks:

- **leading edge**: a wake while idle, at least `min_gap_s` after the last tick started, starts
  a tick at once (the latency a queued job sees is the tick's own time);
- **coalescing**: wakes while a tick runs, or inside the gap, mark one tick pending, however
  many arrive. The pending tick starts when the gap has passed, the running tick has ended and
  no wake came for `quiet_s` (the tail of a burst), but not later than `max_delay_s` after the
  first wake it absorbed (a steady stream cannot starve it), unless the running tick is still
  going. A burst whose events come closer together than `quiet_s` (GitHub sends a matrix's
  jobs within milliseconds) therefore makes at most two ticks: the leading one and the pending
  one, which reads everything the burst queued;
- **interval floor**: with no wake for `interval_s` after a tick started, a tick runs anyway
  (missed events, a relay that is down, jobs that only time can change);
- ticks never overlap (one coroutine runs them in turn), and a tick that raises is counted and
  logged, never the end of the loop.

Pure asyncio and a clock: no Prefect here, so the rules are tested on their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from slurmgate.errors import InputError

log = logging.getLogger("slurmgate.admission.wakeups")


class WakeSettingsError(InputError):
    """The loop's timings do not fit together; the message names the field."""


@dataclass(frozen=True)
class WakeSettings:
    """The loop's timings, in seconds."""

    interval_s: float | None = 30.0  # None: no interval floor, events only
    min_gap_s: float = 1.0
    quiet_s: float = 0.5
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s is not None and self.interval_s <= 0:
            raise WakeSettingsError(
                f"interval_s={self.interval_s:g}: the interval floor must be positive "
                "or None for events only (pass e.g. --interval 30)"
            )
        for name in ("min_gap_s", "quiet_s", "max_delay_s"):
            if getattr(self, name) < 0:
                raise WakeSettingsError(f"{name}={getattr(self, name):g} must be >= 0")
        if self.max_delay_s < self.min_gap_s:
            raise WakeSettingsError(
                f"max_delay_s={self.max_delay_s:g} is below min_gap_s={self.min_gap_s:g}; "
                "raise max_delay_s to at least the gap"
            )


@dataclass
class WakeStats:
    """What the loop did: wakes received, ticks run (and why), ticks that raised."""

    wakes: int = 0
    ticks: int = 0
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


class WakeLoop:
    """Run `tick(reason)` on wakes and on the interval; see the module docstring for the rules."""

    def __init__(
        self,
        tick: Callable[[str], Awaitable[object]],
        settings: WakeSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tick = tick
        self.settings = settings or WakeSettings()
        self.clock = clock
        self.stats = WakeStats()
        self._signal = asyncio.Event()
        self._pending_since: float | None = None
        self._last_wake = 0.0
        self._last_start: float | None = None
        self._last_end = 0.0
        self._reason = "interval"

    def wake(self, reason: str = "event") -> None:
        """Ask for a tick (call from the loop's own event loop thread)."""
        now = self.clock()
        self.stats.wakes += 1
        self._last_wake = now
        if self._pending_since is None:
            self._pending_since = now
            self._reason = reason
        self._signal.set()

    def due_at(self) -> float:
        """When the next tick may start, from what is known now."""
        s = self.settings
        if self._last_start is None:
            return self.clock()
        if self._pending_since is None:
            return math.inf if s.interval_s is None else self._last_start + s.interval_s
        first = self._pending_since
        gap_end = self._last_start + s.min_gap_s
        if first >= self._last_end and first >= gap_end:
            return first  # leading edge: the wake found the loop idle, past the gap
        # the wake came while a tick ran or inside the gap: wait for the gap and for the
        # burst's tail (quiet_s without a wake), but not past max_delay_s
        due = max(gap_end, self._last_end, self._last_wake + s.quiet_s)
        return max(min(due, first + s.max_delay_s), gap_end, self._last_end)

    async def run(self, *, ticks: int | None = None) -> None:
        """Tick for ever (or `ticks` times); the first tick runs at once."""
        while ticks is None or self.stats.ticks < ticks:
            while True:
                self._signal.clear()
                wait = self.due_at() - self.clock()
                if wait <= 0:
                    break
                # a new wake may move the due time (earlier for an idle loop, later in a burst)
                try:
                    timeout = None if math.isinf(wait) else wait
                    await asyncio.wait_for(self._signal.wait(), timeout=timeout)
                except TimeoutError:
                    pass
            waited = self.clock() - self._pending_since if self._pending_since is not None else 0.0
            reason = self._reason if self._pending_since is not None else "interval"
            if self._last_start is None and self._pending_since is None:
                reason = "start"
            self._pending_since = None
            self._last_start = self.clock()
            self.stats.ticks += 1
            self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
            log.info("tick %d (%s), %.2f s after its first wake", self.stats.ticks, reason, waited)
            try:
                await self.tick(reason)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.failed += 1
                log.exception("admission tick (%s) failed; the loop goes on", reason)
            finally:
                self._last_end = self.clock()
