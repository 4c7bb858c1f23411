"""Reservation methods the policy benchmark judges beside the default: simulator-only policies.

The planner's `ReservationBackfill` plans reservations on timeouts and takes only a job starting
beside one at its prediction. These candidates change that one part and are never selectable in
settings: `Predicted` plans everything on predictions (the default before, with its 5 h trigger),
`TimeoutBound` plans on predictions but checks a backfill job for its whole timeout, and
`NarrowAtOnce` keeps the trigger for wide jobs only.
"""

from __future__ import annotations

from slurmgate.admission.capacity import FleetState, JobRequest
from slurmgate.admission.policies import ReservationBackfill


class Predicted(ReservationBackfill):
    """Reservations on predictions: running leases expected back at their predicted ends (then
    their timeouts), a reserved job holding its runners for its prediction."""

    predicted_ends = True

    def reserved_s(self, request: JobRequest) -> float:
        return request.estimate.predicted_s


class TimeoutBound(Predicted):
    """Reservations on predictions, but a job starting beside one is checked for its timeout
    (the kill bound), so a prediction that was too short cannot delay a reserved job."""

    def backfill_s(self, request: JobRequest) -> float:
        return request.estimate.limit_s


class NarrowAtOnce(ReservationBackfill):
    """The trigger (`reserve_after_s`) for wide jobs only: a blocked job needing at most
    `narrow_frac` of its largest compatible pool is reserved at once, as classic EASY does.

    Why: on KTH x0.75 the 1 h trigger let 1-2 node jobs pass young 5-25 node heads, and those
    heads' waits (not the wide ones') raised the mean above classic EASY's."""

    narrow_frac = 0.25

    def due(self, request: JobRequest, fleet: FleetState) -> bool:
        sizes = [fleet.pools[p].total for p in fleet.candidates(request.requirement) if p]
        if sizes and request.nodes <= self.narrow_frac * max(sizes):
            return True
        return super().due(request, fleet)
