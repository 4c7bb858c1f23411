"""Backend selection: least active requests among the lanes the queue policy admits.

Only lanes in rotation (their health probes pass) whose circuit breaker admits them
(``breaker.py``) are candidates. When no lane at all is, the probes and answers are more likely
wrong than every lane dead, so every lane is a candidate again (as a load balancer's panic
mode): requests then fail or succeed on their own, within the first-byte timeout, instead of
all being refused.

Ties are broken by a rotating cursor: the scan starts one past the lane picked last, and the
first lane with the lowest in-flight count wins. That is deterministic for a given sequence of
requests and, unlike "lowest index first", spreads sequential traffic evenly over idle lanes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from slurmgate.runtime.endpoint.backpressure import Lane, QueuePolicy


class LeastActiveRouter:
    """Picks a lane for each attempt; the caller owns incrementing and releasing ``lane.active``."""

    def __init__(self, lanes: Sequence[Lane], policy: QueuePolicy) -> None:
        if not lanes:
            raise ValueError("backends: at least one backend is required")
        self.lanes = list(lanes)
        self.policy = policy
        self._cursor = 0

    def pick(self, now: float, exclude: Collection[Lane] = ()) -> Lane | None:
        """The admitted, not yet tried lane in rotation with the fewest in-flight requests."""
        lanes = self.lanes
        count = len(lanes)
        start = self._cursor
        best: Lane | None = None
        best_at = 0  # best's position in this router's lanes (a role's router has a subset)
        admits = self.policy.admits
        any_in_rotation = False
        for offset in range(count):
            lane = lanes[(start + offset) % count]
            if not lane.in_rotation or (lane.breaker.tripped and not lane.breaker.admits(now)):
                continue
            any_in_rotation = True
            if best is not None and lane.active >= best.active:
                continue
            if lane in exclude or not admits(lane, now):
                continue
            best, best_at = lane, (start + offset) % count
            if best.active == 0:
                break
        if best is None and not any_in_rotation:
            for offset in range(count):
                lane = lanes[(start + offset) % count]
                if best is not None and lane.active >= best.active:
                    continue
                if lane in exclude or not admits(lane, now):
                    continue
                best, best_at = lane, (start + offset) % count
        if best is not None:
            self._cursor = (best_at + 1) % count
            if best.breaker.tripped:
                best.breaker.picked(now)  # a half-open lane's one probe
        return best

    def all_over_limit(self, now: float) -> bool:
        return not any(self.policy.admits(lane, now) for lane in self.lanes)
