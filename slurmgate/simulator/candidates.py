"""Reservation methods the policy benchmark judges beside the default: simulator-only policies.

The planner's `ReservationBackfill` plans reservations on timeouts and takes only a job starting
beside one at its prediction. These candidates change that one part and are never selectable in
settings: `Predicted` plans everything on predictions (the default before, with its 5 h trigger),
and `TimeoutBound` plans on predictions but checks a backfill job for its whole timeout. (The
wide-job rules that began here, a trigger for wide jobs only and timeouts beside a wide job's
reservation, are the planner's `wide_fraction` now.)
"""

from __future__ import annotations

from slurmgate.admission.capacity import JobRequest
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

    def backfill_s(self, request: JobRequest, holder_share: float = 0.0) -> float:
        return request.estimate.limit_s
