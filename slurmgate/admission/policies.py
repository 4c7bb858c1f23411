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
from slurmgate.admission.settings import POLICY_NAMES, AdmissionSettings

SLOWDOWN_FLOOR_S = 10.0
"""The runtime floor of the slowdown trigger: bounded slowdown's usual 10 s (Feitelson et al.,
"Theory and Practice in Parallel Job Scheduling", 1997), so a job estimated at seconds is not
reserved the moment it is blocked."""

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

    In priority order, a job starts now if it fits now on a pool and, for the whole of its
    predicted runtime, in that pool's profile of expected free runners minus the reservations
    already made. A job that cannot start gets a reservation at its earliest start on the
    compatible pool where that start comes first, while that pool holds fewer than `depth`
    reservations. With depth 1 this is EASY: only the top blocked job of each pool is protected,
    and a backfill job must end before its reservation or use only the runners it leaves over.
    With `reserve_after_s` a blocked job gets a reservation only once it has waited that long
    (Slurm's bf_min_age_reserve): younger jobs backfill greedily, old ones cannot starve.
    With `reserve_slowdown` B instead, the trigger comes from the job itself: it is reserved
    once wait / max(estimated runtime, SLOWDOWN_FLOOR_S) >= B, so a short job is protected
    after a short wait and a long one after a long wait, whatever the workload's job lengths.
    With `reserve_after_runtimes` k, the trigger comes from the workload now running: a job is
    reserved once it has waited k x the `runtime_quantile` of the estimated runtimes of the
    leases running on its pools (at once when none runs there), or `reserve_after_s` if that
    is set and shorter: a workload of short jobs protects sooner than the fixed wait.
    With `backfill_order` "shortest" (EASY++'s order), jobs due a reservation are still taken
    in priority order, but the younger ones backfill shortest estimate first.
    With `reserve_wide_frac` f, a job needing more than f of its largest compatible pool is
    due at once (classic EASY for wide jobs), the others wait for their trigger.
    With `backfill_bound` "timeout", a job is checked against a pool's reservations for its
    whole timeout rather than its prediction: a prediction that was too short then cannot push
    a reserved job back (EASY's guarantee, with the kill bound Slurm enforces), while the
    predictions still set the reservations and everything on pools that hold none.
    """

    def __init__(
        self,
        name: str,
        depth: int,
        reserve_after_s: float = 0.0,
        reserve_slowdown: float | None = None,
        reserve_after_runtimes: float | None = None,
        runtime_quantile: float = 0.5,
        backfill_order: str = "priority",
        backfill_bound: str = "predicted",
        reserve_wide_frac: float | None = None,
    ) -> None:
        self.name = name
        self.depth = depth
        self.reserve_after_s = reserve_after_s
        self.reserve_slowdown = reserve_slowdown
        self.reserve_after_runtimes = reserve_after_runtimes
        self.runtime_quantile = runtime_quantile
        self.backfill_order = backfill_order
        self.backfill_bound = backfill_bound
        self.reserve_wide_frac = reserve_wide_frac

    def due(
        self,
        request: JobRequest,
        now_s: float,
        fleet: FleetState | None = None,
        typical: dict[tuple[str, ...], float] | None = None,
    ) -> bool:
        """Whether a blocked job has waited long enough for a reservation (`typical` caches
        the running-runtime quantile per pool set for one walk)."""
        if request.skip_queue:  # a skip-queue job is protected at once
            return True
        if self.reserve_wide_frac is not None and fleet is not None:
            largest = max(
                (
                    fleet.total_for(pool, allowed)
                    for pool, allowed in fleet.candidates(request.requirement).items()
                    if pool is not None
                ),
                default=0,
            )
            if request.nodes > self.reserve_wide_frac * largest:
                return True
        waited = now_s - request.job.created_at.timestamp()
        if self.reserve_slowdown is not None:
            runtime = max(request.estimate.predicted_s, SLOWDOWN_FLOOR_S)
            return waited >= self.reserve_slowdown * runtime
        if self.reserve_after_runtimes is not None and fleet is not None:
            runtime = running_quantile(fleet, request, self.runtime_quantile, typical)
            delay = self.reserve_after_runtimes * runtime
            if self.reserve_after_s:  # the fixed wait, when set, caps it
                delay = min(delay, self.reserve_after_s)
            return waited >= delay
        return not self.reserve_after_s or waited >= self.reserve_after_s

    def order(
        self,
        requests: Sequence[JobRequest],
        fleet: FleetState,
        typical: dict[tuple[str, ...], float],
    ) -> Sequence[JobRequest]:
        """The walk's order: priority, or (backfill_order "shortest") the jobs due a
        reservation in priority order, then the rest shortest estimate first."""
        if self.backfill_order != "shortest":
            return requests
        due = [r for r in requests if self.due(r, fleet.now_s, fleet, typical)]
        if len(due) == len(requests):
            return requests
        chosen = {id(r) for r in due}
        rest = [r for r in requests if id(r) not in chosen]
        rest.sort(key=lambda r: r.estimate.predicted_s)  # stable: priority breaks ties
        return [*due, *rest]

    def walk(self, requests: Sequence[JobRequest], walk: Walk) -> None:
        fleet = walk.fleet
        profiles: dict[str, Profile] = {}
        held: dict[str, int] = {}
        # pools with `depth` reservations: nothing more can be reserved there
        full: set[str] = set()
        typical: dict[tuple[str, ...], float] = {}
        bounded = self.backfill_bound == "timeout"
        for request in self.order(requests, fleet, typical):
            nodes = request.nodes
            duration = request.estimate.limit_s if bounded else request.estimate.predicted_s
            if profiles:

                def allow(pool: str, nodes: int = nodes, duration: float = duration) -> bool:
                    profile = profiles.get(pool)
                    return profile is None or profile.fits_now(nodes, duration)

                outcome = fit_now(request, fleet, allow)
            else:
                outcome = fit_now(request, fleet)
            if isinstance(outcome, Placement):
                walk.settle(outcome)
                if outcome.pool in profiles:
                    profiles[outcome.pool].reserve(fleet.now_s, duration, nodes)
                continue
            if outcome.reason in (BlockReason.NO_CAPACITY, BlockReason.RESERVED) and self.due(
                request, fleet.now_s, fleet, typical
            ):
                reserved = self._reserve(request, fleet, profiles, held, full)
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
        for pool, allowed in fleet.candidates(request.requirement).items():
            if pool is None or pool in full or fleet.pools[pool].cordoned is not None:
                continue
            if fleet.total_for(pool, allowed) < request.nodes:
                continue
            profile = profiles.get(pool)
            if profile is None:
                profile = profiles[pool] = fleet.profile(pool)
            start = profile.earliest(request.nodes, request.estimate.predicted_s)
            if start is not None and (best is None or (start, pool) < best):
                best = (start, pool)
        if best is None:
            return None
        start, pool = best
        profiles[pool].reserve(start, request.estimate.predicted_s, request.nodes)
        held[pool] = held.get(pool, 0) + 1
        if held[pool] >= self.depth:
            full.add(pool)
        return pool, start


def running_quantile(
    fleet: FleetState,
    request: JobRequest,
    quantile: float,
    cache: dict[tuple[str, ...], float] | None = None,
) -> float:
    """The `quantile` of the estimated runtimes of the leases running on the pools `request`
    could use (0 when none runs there): the workload's current job length, as the planner
    predicts it. `cache` keeps it per pool set while the fleet does not change (one walk)."""
    pools = tuple(p for p in fleet.candidates(request.requirement) if p is not None)
    cached = cache.get(pools) if cache is not None else None
    if cached is not None:
        return cached
    runtimes = sorted(
        lease.estimate.predicted_s
        for pool in pools
        for lease in fleet.running.get(pool, {}).values()
    )
    value = runtimes[min(len(runtimes) - 1, int(quantile * len(runtimes)))] if runtimes else 0.0
    if cache is not None:
        cache[pools] = value
    return value


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
    knobs = (
        settings.reserve_after_s,
        settings.reserve_slowdown,
        settings.reserve_after_runtimes,
        settings.reserve_runtime_quantile,
        settings.backfill_order,
        settings.backfill_bound,
        settings.reserve_wide_frac,
    )
    if chosen == "conservative":
        return ReservationBackfill("conservative", settings.reservation_depth, *knobs)
    classic = (0.0, None, None, knobs[3], "priority", "predicted", None)
    if chosen == "easy" and knobs != classic:
        return ReservationBackfill("easy", 1, *knobs)
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
