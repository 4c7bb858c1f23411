"""A lane's circuit breaker: out of rotation after repeated failed answers, back by one probe.

Health probes see a lane whose ``/health`` fails; they do not see one whose ``/health`` answers
200 while its requests fail (an engine that 500s every completion, or resets). The breaker
judges the lane by the outcomes of real attempts instead: a failure is a 5xx answer, a reset or
broken answer, a failed connect or a first-byte timeout; any other answer (4xx included: the
client was wrong, or the lane said it is busy) is a success. ``failures`` failures in a row
open it: the lane takes no request for ``open_s`` seconds. Then it is half open: one request
may go as a probe, and its outcome closes the breaker or opens it again, each time in a row for
twice as long (at most ``MAX_BACKOFF`` times ``open_s``). A probe that ends with no outcome
(the client left) frees the slot; one that was never settled frees it after ``open_s``.

Pure state: the caller passes the clock's reading and owns the lane.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_BACKOFF = 8


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass
class Breaker:
    """One lane's breaker; ``failures`` 0 turns it off."""

    failures: int = 5
    open_s: float = 10.0
    state: BreakerState = BreakerState.CLOSED
    failed_in_row: int = 0
    opened_at: float = 0.0
    open_for: float = 0.0
    probe_since: float | None = None  # a probe is out (half open)
    trips: int = 0  # times it opened, for the metrics
    tripped: bool = False  # state is not CLOSED: the router's one cheap check

    def admits(self, now: float) -> bool:
        """Whether a request may go to the lane now (a half-open lane admits its one probe)."""
        if not self.tripped:
            return True
        if self.state is BreakerState.OPEN:
            if now - self.opened_at < self.open_for:
                return False
            self.state = BreakerState.HALF_OPEN
        probe = self.probe_since
        return probe is None or now - probe >= self.open_s

    def picked(self, now: float) -> None:
        """The router sent the lane a request: in half-open state it is the probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_since = now

    def record(self, ok: bool, now: float) -> None:
        """The outcome of one attempt on the lane."""
        if self.failures <= 0:
            return
        if ok:
            self.failed_in_row = 0
            self.state, self.tripped, self.probe_since = BreakerState.CLOSED, False, None
            self.open_for = 0.0
            return
        self.failed_in_row += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self.failed_in_row >= self.failures
        ):
            doubled = self.open_for * 2 if self.open_for else self.open_s
            self.open_for = min(doubled, self.open_s * MAX_BACKOFF)
            self.state, self.tripped, self.probe_since = BreakerState.OPEN, True, None
            self.opened_at = now
            self.trips += 1

    def abandoned(self) -> None:
        """An attempt ended with no outcome (the client left, the lane left rotation)."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_since = None
