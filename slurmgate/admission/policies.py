"""The admission policies: the order queued jobs are taken in, and how each one is fitted.

`greedy` (the seed: admit whatever fits; a wide job can starve behind a stream of small ones),
`easy` (EASY backfill: the top blocked job of each pool gets a reservation at its earliest
start, and a job backfills only if it does not delay it), `conservative` (every blocked job up
to `reservation_depth` per pool gets one), and the simulator-only `fcfs` baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from decimal import Decimal

from slurmgate.admission.capacity import LEGACY, FleetState, JobRequest, Placement, Profile
from slurmgate.admission.model import Blocked, BlockReason
from slurmgate.settings.admission import POLICY_NAMES, AdmissionSettings

SKIP_QUEUE_PRIORITY = "skip-queue"
"""How a verified skip-queue job's priority is shown (admit lines, the board) instead of a score."""


def priority_key(request: JobRequest) -> tuple[bool, Decimal, int, datetime, int]:
    return (
        not request.skip_queue,
        -request.score,
        request.nodes,
        request.job.created_at,
        request.job.id,
    )


def priority_order(requests: Iterable[JobRequest]) -> list[JobRequest]:
    """Verified skip-queue jobs first (the seed: they outrank every numeric priority), then score
    desc, then fewer nodes, then older, then lower job id: a total, deterministic order. Among
    skip-queue jobs the same score, size and age order holds."""
    return sorted(requests, key=priority_key)


class Walk:
    """One pass of a policy over the queue: what it admitted, and why the rest wait."""

    def __init__(self, fleet: FleetState, explain: bool) -> None:
        self.fleet = fleet
        self.explain = explain
        self.placements: list[Placement] = []
        self.blocked: list[Blocked] = []

    def settle(self, outcome: Placement | Blocked) -> bool:
        """Start a placement (True), or note why the job waits."""
        if isinstance(outcome, Placement):
            self.fleet.start(outcome)
            self.placements.append(outcome)
            return True
        self.note(outcome)
        return False

    def note(self, outcome: Blocked) -> None:
        """Count a blocked job against its pool (only when someone reads the reasons)."""
        if not self.explain:
            return
        if outcome.pool is not None and outcome.pool in self.fleet.pools:
            self.fleet.pools[outcome.pool].blocked += 1
        self.blocked.append(outcome)


class AdmissionPolicy:
    """Orders the queued requests and fits each one to the fleet; mutates `fleet` as it admits.

    Subclasses say what each request gets in `walk`, which sees them in priority order.
    `ordered=True` says `requests` is already in `priority_order` (the simulator keeps its queue
    sorted); `explain=False` lets a policy skip building Blocked entries nobody will read.
    """

    name: str

    def place(
        self,
        requests: Sequence[JobRequest],
        fleet: FleetState,
        *,
        ordered: bool = False,
        explain: bool = True,
    ) -> tuple[list[Placement], list[Blocked]]:
        walk = Walk(fleet, explain)
        self.walk(requests if ordered else priority_order(requests), walk)
        return walk.placements, walk.blocked

    def walk(self, requests: Sequence[JobRequest], walk: Walk) -> None:
        raise NotImplementedError


class GreedyBackfill(AdmissionPolicy):
    """Walk the priority order and admit every job that fits now; smaller jobs backfill."""

    name = "greedy"

    def walk(self, requests: Sequence[JobRequest], walk: Walk) -> None:
        for request in requests:
            walk.settle(fit_now(request, walk.fleet))


class StrictOrder(AdmissionPolicy):
    """FCFS baseline: admit in priority order and stop at the first job that must wait.

    Not selectable in settings (it idles capacity and is unstable at real loads); the simulator
    uses it as the reference point. Jobs that can never fit are rejected, not waited for.
    """

    name = "fcfs"

    def walk(self, requests: Sequence[JobRequest], walk: Walk) -> None:
        head: JobRequest | None = None
        for request in requests:
            if head is not None:
                if not walk.explain:
                    break
                reason = f"strict order: waits behind job {head.job.id}"
                walk.note(
                    Blocked(request.job.id, request.nodes, None, BlockReason.RESERVED, reason)
                )
                continue
            outcome = fit_now(request, walk.fleet)
            if isinstance(outcome, Blocked) and outcome.reason == BlockReason.NO_CAPACITY:
                head = request
            walk.settle(outcome)


class ReservationBackfill(AdmissionPolicy):
    """Backfill that never delays a reservation: EASY (depth 1) or conservative (depth N).

    In priority order, a job starts now if it fits now on a pool and, for its predicted
    runtime, in that pool's profile of free runners minus the reservations already made. A job
    that cannot start gets a reservation at its earliest start on the compatible pool where
    that start comes first, while that pool holds fewer than `depth` reservations. With depth 1
    this is EASY: only the top blocked job of each pool is protected, and a backfill job must
    end before its reservation or use only the runners it leaves over.

    Reservations are planned on timeouts, as classic EASY plans them on user limits: a running
    lease is expected back at its timeout (then one overrun extension at a time), and a
    reserved job holds its runners for its own timeout. Only the job that would start beside a
    reservation is taken at its prediction (a learned estimate; the timeout without one), so
    the slack between timeouts and real ends absorbs a prediction that was too short.
    With `reserve_after_s` a blocked job gets a reservation only once it has waited that long
    (Slurm's bf_min_age_reserve): younger jobs backfill greedily.

    With `wide_fraction` a job needing more than that part of its largest compatible pool is
    wide: only wide jobs wait for the trigger (a narrower one is reserved at once, as classic
    EASY does), and a job starting beside a wide job's reservation is taken at its timeout, so
    a prediction that was too short cannot push a wide start; beside a narrow one it is taken
    at its prediction. Why: under heavy load the trigger let small jobs pass young 5-25 node
    heads, and predictions that ran long delayed convoys of wide jobs.

    The simulator's candidates subclass this and override `due`, `order`, `backfill_s`,
    `reserved_s` or `predicted_ends`.
    """

    predicted_ends = False
    """Plan the profile on running leases' predicted ends instead of their timeouts."""

    def __init__(
        self,
        name: str,
        depth: int,
        reserve_after_s: float = 0.0,
        wide_fraction: float | None = None,
    ) -> None:
        self.name = name
        self.depth = depth
        self.reserve_after_s = reserve_after_s
        self.wide_fraction = wide_fraction

    def due(self, request: JobRequest, fleet: FleetState) -> bool:
        """Whether a blocked job has waited long enough for a reservation."""
        if request.skip_queue or not self.reserve_after_s:  # a skip-queue job at once
            return True
        if self.wide_fraction is not None:
            sizes = [fleet.pools[p].total for p in fleet.candidates(request.requirement) if p]
            if sizes and request.nodes <= self.wide_fraction * max(sizes):
                return True  # a narrow job: reserved at once
        return fleet.now_s - request.job.created_at.timestamp() >= self.reserve_after_s

    def order(self, requests: Sequence[JobRequest], fleet: FleetState) -> Sequence[JobRequest]:
        """The order jobs are tried in: priority."""
        return requests

    def backfill_s(self, request: JobRequest, holder_share: float = 0.0) -> float:
        """How long a job starting beside a reservation is taken to run; `holder_share` is the
        part of the pool the pool's first reservation needs."""
        if self.wide_fraction is not None and holder_share > self.wide_fraction:
            return request.estimate.limit_s  # beside a wide reservation: its kill bound
        return request.estimate.predicted_s

    def reserved_s(self, request: JobRequest) -> float:
        """How long a reserved job is taken to hold its runners."""
        return request.estimate.limit_s

    def walk(self, requests: Sequence[JobRequest], walk: Walk) -> None:
        fleet = walk.fleet
        profiles: dict[str, Profile] = {}
        held: dict[str, int] = {}
        shares: dict[str, float] = {}  # the part of each pool its first reservation needs
        # pools with `depth` reservations: nothing more can be reserved there
        full: set[str] = set()
        for request in self.order(requests, fleet):
            nodes = request.nodes
            if profiles:

                def allow(pool: str, request: JobRequest = request) -> bool:
                    profile = profiles.get(pool)
                    if profile is None:
                        return True
                    duration = self.backfill_s(request, shares.get(pool, 0.0))
                    return profile.fits_now(request.nodes, duration)

                outcome = fit_now(request, fleet, allow)
            else:
                outcome = fit_now(request, fleet)
            if isinstance(outcome, Placement):
                walk.settle(outcome)
                if outcome.pool in profiles:
                    duration = self.backfill_s(request, shares.get(outcome.pool, 0.0))
                    profiles[outcome.pool].reserve(fleet.now_s, duration, nodes)
                continue
            if outcome.reason in (BlockReason.NO_CAPACITY, BlockReason.RESERVED) and self.due(
                request, fleet
            ):
                reserved = self._reserve(request, fleet, profiles, held, full)
                if reserved is not None and reserved[0] not in shares:
                    shares[reserved[0]] = nodes / max(fleet.pools[reserved[0]].total, 1)
                if reserved is not None and walk.explain:
                    pool, start = reserved
                    outcome = Blocked(
                        request.job.id,
                        nodes,
                        pool,
                        outcome.reason,
                        f"{outcome.detail}; reserved {pool} in {start - fleet.now_s:.0f}s",
                    )
            walk.note(outcome)

    def _reserve(
        self,
        request: JobRequest,
        fleet: FleetState,
        profiles: dict[str, Profile],
        held: dict[str, int],
        full: set[str],
    ) -> tuple[str, float] | None:
        best: tuple[float, str] | None = None
        duration = self.reserved_s(request)
        for pool, allowed in fleet.candidates(request.requirement).items():
            if pool is None or pool in full or fleet.pools[pool].cordoned is not None:
                continue
            if fleet.total_for(pool, allowed) < request.nodes:
                continue
            profile = profiles.get(pool)
            if profile is None:
                profile = profiles[pool] = fleet.profile(pool, self.predicted_ends)
            start = profile.earliest(request.nodes, duration)
            if start is not None and (best is None or (start, pool) < best):
                best = (start, pool)
        if best is None:
            return None
        start, pool = best
        profiles[pool].reserve(start, duration, request.nodes)
        held[pool] = held.get(pool, 0) + 1
        if held[pool] >= self.depth:
            full.add(pool)
        return pool, start


POLICIES: dict[str, AdmissionPolicy] = {
    policy.name: policy
    for policy in (
        GreedyBackfill(),
        ReservationBackfill("easy", 1),
        ReservationBackfill("conservative", 32),
    )
}
assert tuple(POLICIES) == POLICY_NAMES, "settings.PolicyName and POLICIES must name the same"
BASELINES: dict[str, AdmissionPolicy] = {"fcfs": StrictOrder()}
SIMULATED_POLICY_NAMES: tuple[str, ...] = (*BASELINES, *POLICIES)
"""Every policy the simulator can replay: the baselines, then the selectable ones."""


def policy_named(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r} (SLURMGATE_POLICY); choose one of "
            f"{', '.join(sorted(POLICIES))}"
        ) from None


def policy_for(settings: AdmissionSettings, name: str | None = None) -> AdmissionPolicy:
    """The policy `name` (default: the settings' policy) with the settings' knobs applied.

    Also accepts the `fcfs` baseline, which only the simulator asks for.
    """
    chosen = name or settings.policy
    if chosen == "conservative":
        return ReservationBackfill(
            "conservative",
            settings.reservation_depth,
            settings.reserve_after_s,
            settings.wide_fraction,
        )
    if chosen == "easy" and (settings.reserve_after_s or settings.wide_fraction is not None):
        return ReservationBackfill("easy", 1, settings.reserve_after_s, settings.wide_fraction)
    if chosen in BASELINES:
        return BASELINES[chosen]
    return policy_named(chosen)


def fit_now(
    request: JobRequest, fleet: FleetState, allow: Callable[[str], bool] | None = None
) -> Placement | Blocked:
    """Place one request on the best-fitting compatible pool, or say why it cannot be placed.

    `allow` (a reservation policy's check) can veto pools; a job that only vetoed pools could
    take now is blocked as held for a reservation.
    """
    job, nodes = request.job, request.nodes
    candidates = fleet.candidates(request.requirement)
    if not candidates:
        return Blocked(
            job.id,
            nodes,
            None,
            BlockReason.NO_POOL,
            "no online-or-offline runner carries all of its labels "
            f"({', '.join(sorted(request.requirement)) or 'none'})",
        )
    if fleet.gate is not None:  # the repository and team quotas (admission/fairness.py)
        refused = fleet.gate.refuse(request, fleet)
        if refused is not None:
            return refused
    if nodes == 1 and None in candidates:
        free = fleet.free_for(None, candidates[None])
        if free:
            return Placement(request, None, (free[0],))
    possible = [
        (pool, allowed)
        for pool, allowed in candidates.items()
        if pool is not None and fleet.total_for(pool, allowed) >= nodes
    ]
    if not possible:
        return _never_fits(request, fleet, candidates)
    fitting: list[tuple[int, str, frozenset[int] | None]] = []
    vetoed: str | None = None
    for pool, allowed in possible:
        if fleet.headroom(pool) < nodes:
            continue
        count = fleet.free_count(pool, allowed)
        if count >= nodes:
            if allow is not None and not allow(pool):
                vetoed = vetoed or pool
                continue
            fitting.append((count, pool, allowed))
    if fitting:
        _, pool, allowed = min(fitting, key=lambda e: (e[0], e[1]))
        return Placement(request, pool, tuple(fleet.free_for(pool, allowed)[:nodes]))
    if vetoed is not None:
        return Blocked(
            job.id,
            nodes,
            vetoed,
            BlockReason.RESERVED,
            f"needs {nodes}: {vetoed} has them free, but starting now would delay a reservation",
        )
    open_pools = [(p, a) for p, a in possible if fleet.pools[p].cordoned is None]
    if not open_pools:  # every pool it could use is cordoned: its leases finish first
        pool = possible[0][0]
        why = fleet.pools[pool].cordoned
        cordoned = ", ".join(p for p, _ in possible)
        detail = f"needs {nodes}: {cordoned} cordoned ({why}); `slurmgate uncordon` reopens"
        return Blocked(job.id, nodes, pool, BlockReason.CORDONED, detail)
    pool, allowed = min(open_pools, key=lambda e: (-fleet.free_count(e[0], e[1]), e[0]))
    state = fleet.pools[pool]
    free_count = fleet.free_count(pool, allowed)
    detail = (
        f"needs {nodes}, {pool} has {free_count} free of {state.online} online "
        f"({state.in_use} in use)"
    )
    if state.slurm is not None and fleet.slurm_short(pool, nodes):
        # the runners would take it: say what Slurm lacks, node by node
        why = "; ".join(state.slurm.reasons()) or "its nodes are taken by leases"
        detail = (
            f"needs {nodes}, Slurm can give {fleet.headroom(pool)} in partition "
            f"{state.slurm.partition} now ({why}); {pool} has {free_count} free runners"
        )
    return Blocked(job.id, nodes, pool, BlockReason.NO_CAPACITY, detail)


def _never_fits(
    request: JobRequest, fleet: FleetState, candidates: dict[str | None, frozenset[int] | None]
) -> Blocked:
    job, nodes = request.job, request.nodes
    sized = [
        (pool, fleet.total_for(pool, allowed))
        for pool, allowed in candidates.items()
        if pool is not None
    ]
    if nodes == 1:  # only legacy runners are compatible, and none is free
        return Blocked(
            job.id,
            nodes,
            None,
            BlockReason.NO_CAPACITY,
            f"needs 1, {LEGACY} has no free compatible runner",
        )
    if sized:
        largest, size = max(sized, key=lambda e: (e[1], e[0] or ""))
        detail = f"needs {nodes}, largest compatible pool {largest} has {size} runners"
        return Blocked(job.id, nodes, largest, BlockReason.NEVER_FITS, detail)
    detail = f"needs {nodes}, only legacy runners are compatible and they serve 1 node"
    return Blocked(job.id, nodes, None, BlockReason.NEVER_FITS, detail)
