"""The admission planner: one pure function from a fleet snapshot to lease decisions.

`plan()` is mechanism (leases from labels, releases, cleans, capacity bookkeeping); the order in
which queued jobs are considered and how each is fitted is a policy object chosen by name
(`AdmissionSettings.policy`), so reservation policies can replace greedy backfill without
touching the rest. The simulator (`slurmgate.simulator`) drives these same policy objects on a
long-lived `FleetState`; there is one implementation of ordering, fit and reservations.

Policies: `greedy` (the seed: admit whatever fits; a wide job can starve behind a stream of
small ones), `easy` (EASY backfill: the top blocked job of each pool gets a reservation at its
earliest start, and a job backfills only if it does not delay it), `conservative` (every blocked
job up to `reservation_depth` per pool gets one), and the simulator-only `fcfs` baseline.

Recommended setting (measured by `benchmarks/bench_policies.py` on KTH, KTH x0.8, KTH on five
pools, LANL/32 and the InferenceX mix; table in `benchmarks/results/policies.md`):
`SLURMGATE_POLICY=easy` with the default knobs, i.e. learned estimates (the 0.8 quantile of the
job key's past runtimes, bounded by its timeout) and `SLURMGATE_RESERVE_AFTER_S=18000`: a job
that has waited 5 h gets an EASY reservation, younger jobs backfill greedily. It keeps greedy's
mean wait (KTH 1.69 h; greedy 1.60 h, classic EASY 1.91 h) and EASY's bound on wide jobs (KTH
72.4 h; EASY 72.8 h, greedy 479 h), and meets that benchmark's three targets on every scenario;
it is the default.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from slurmgate.admission.capacity import (
    LEGACY,
    FleetState,
    JobRequest,
    NodeCapacity,
    Placement,
    PoolState,
    RunningLease,
)
from slurmgate.admission.estimates import Estimate, Estimator, RuntimeHistory, job_key
from slurmgate.admission.fairness import (
    Fairness,
    QuotaBook,
    cap_scores,
    fair_share_order,
    repo_usage,
)
from slurmgate.admission.labels import (
    ANCHOR_PREFIXES,
    CLUSTER_PREFIX,
    JOB_PREFIX,
    LEASE_PREFIX,
    JobLabel,
    LabelError,
    LeaseLabel,
    check_managed_ascii,
    fold,
    parse_nodes,
    unmanaged,
)
from slurmgate.admission.model import (
    NOT_STARTED,
    Admit,
    Blocked,
    BlockReason,
    Clean,
    Decisions,
    Job,
    JobStatus,
    Lease,
    PoolRow,
    Release,
    ReleaseReason,
    Runner,
    Snapshot,
    leases_from_fleet,
)
from slurmgate.admission.policies import SKIP_QUEUE_PRIORITY, policy_for, priority_order
from slurmgate.settings.admission import AdmissionSettings

# Release reasons that read the lease's runners: a partial fleet cannot tell them apart from
# a runner GitHub listed in a shape we could not read.
_SEEN_BY_RUNNERS = frozenset(
    {ReleaseReason.NO_ANCHOR, ReleaseReason.INCOMPLETE, ReleaseReason.CONFLICT_LOST}
)


# ---- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Facts:
    """A runner's label facts, folded and computed once per plan."""

    pools: tuple[str, ...]
    folded: frozenset[str]
    lease_labels: tuple[str, ...]
    job_labels: tuple[str, ...]

    @property
    def pool(self) -> str | None:
        return self.pools[0] if len(self.pools) == 1 else None

    @property
    def misconfigured(self) -> bool:
        return len(self.pools) > 1

    @classmethod
    def of(cls, runner: Runner) -> _Facts:
        folded = frozenset(fold(label) for label in runner.labels)
        return cls(
            pools=tuple(sorted(x for x in folded if x.startswith(CLUSTER_PREFIX))),
            folded=folded,
            lease_labels=tuple(sorted(x for x in folded if x.startswith(LEASE_PREFIX))),
            job_labels=tuple(sorted(x for x in folded if x.startswith(ANCHOR_PREFIXES))),
        )


@dataclass(slots=True)
class _Work:
    releases: list[Release] = field(default_factory=list)
    cleans: list[Clean] = field(default_factory=list)
    blocked: list[Blocked] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


EstimateFn = Callable[[Job, int], Estimate]
"""A job (and its node count) to its runtime estimate; `estimator_for` builds the usual one."""


def estimator_for(settings: AdmissionSettings, history: RuntimeHistory | None = None) -> EstimateFn:
    """Estimates from the settings: the job's timeout, or its key's learned runtime quantile."""
    estimator = Estimator(
        settings.estimates, settings.estimate_quantile, settings.estimate_min_samples, history
    )

    def estimate(job: Job, nodes: int) -> Estimate:
        return estimator.estimate(job_key(job.name, nodes), settings.timeout_s(job.name))

    return estimate


def plan(
    snapshot: Snapshot,
    settings: AdmissionSettings,
    now: datetime,
    *,
    history: RuntimeHistory | None = None,
    estimate: EstimateFn | None = None,
    slurm: Mapping[str, NodeCapacity] | None = None,
) -> Decisions:
    """Decide which leases to create, which to release and which stray labels to clean.

    Pure and deterministic: it reads only its arguments, and the same snapshot (in any order)
    gives the same decisions. Rules worth knowing:

    - A runner is a free token when it is online, idle, in exactly one pool (or legacy) and
      carries no `ci-lease-*` and no per-job label. Capacity is the pool's online runners; in
      use is, per kept lease, max(holders, the anchor's nodes:N), so an offline leased runner
      still counts as in use. An admission needs N free compatible tokens of one pool and
      in-use + N <= online. Runners of a lease released in this plan stay unavailable until the
      release is carried out: they become free on the next plan.
    - A 1-node job takes a free legacy runner first (keeping pool tokens for multi-node jobs).
    - Releases: lost conflict, job completed, job missing (404), no anchor after the grace,
      still not started after `queued_lease_limit_s` (the knob, or the job's timeout), fewer
      holders than nodes:N while not started. A lease whose job is absent from the snapshot is
      kept (a note says so).
    - Cleans (priority scheduler on only): malformed lease labels anywhere, and per-job labels
      on idle runners that do not anchor a lease. Only managed families are ever named.
    - With PRIORITY_SCHEDULER_ENABLED off: no admissions and no cleans (static `nodes:` labels
      may still be in use); only leases whose job finished or vanished are released.
    - Reservation policies (easy, conservative) see each kept lease end at its job's
      `started_at` (now, if not started) plus its estimate; `history` feeds learned estimates,
      `estimate` replaces the estimator altogether (the simulator passes the trace's).
    - `slurm` (pool -> what Slurm says of its partition) makes Slurm the final authority for
      those pools: an admission also needs the nodes (`FleetState.headroom`), a job the runners
      would take but Slurm cannot is blocked naming the missing nodes, and the reservation
      policies see outside jobs' and reservations' end times. Other pools count runners only.
    """
    policy = policy_for(settings)
    estimate = estimate or estimator_for(settings, history)
    runners = sorted(snapshot.runners, key=lambda r: r.id)
    by_id = {r.id: r for r in runners}
    facts = {r.id: _Facts.of(r) for r in runners}
    jobs = {j.id: j for j in sorted(snapshot.jobs, key=lambda j: j.id)}
    now_s = now.timestamp()
    work = _Work()

    misconfigured = tuple(
        (
            r.id,
            f"runner {r.name} carries {len(facts[r.id].pools)} cluster labels "
            f"({', '.join(facts[r.id].pools)}); keep exactly one cluster:<name> label",
        )
        for r in runners
        if facts[r.id].misconfigured
    )

    # malformed lease labels are found again per runner by _cleans
    leases, _ = leases_from_fleet(runners)
    released = _releases(
        leases, jobs, snapshot.missing_job_ids, snapshot.unreadable_runners, by_id, settings,
        now_s, work,
    )  # fmt: skip
    kept = [lease for lease in leases if lease.label not in released]
    if not settings.PRIORITY_SCHEDULER_ENABLED:
        work.releases = [
            r
            for r in work.releases
            if r.reason in (ReleaseReason.JOB_FINISHED, ReleaseReason.JOB_MISSING)
        ]
        kept = [
            lease for lease in leases if lease.label not in {r.lease_label for r in work.releases}
        ]
        work.notes.append(
            "priority scheduler disabled (PRIORITY_SCHEDULER_ENABLED=false): admitting nothing, "
            "releasing only leases whose job finished or vanished"
        )
    else:
        _cleans(runners, facts, leases, work)

    fleet = _fleet_state(runners, facts, kept, settings, now_s)
    for pool, capacity in (slurm or {}).items():
        if pool in fleet.pools:
            fleet.pools[pool].slurm = capacity
    for pool, why in settings.cordoned_pools.items():
        if pool in fleet.pools:
            fleet.pools[pool].cordoned = why
    _running_leases(fleet, kept, jobs, settings, estimate)
    placements: list[Placement] = []
    capped: dict[int, str] = {}
    if settings.PRIORITY_SCHEDULER_ENABLED:
        requests = _requests(
            snapshot.jobs,
            leases,
            settings,
            work,
            estimate,
            snapshot.skip_queue_job_ids,
            snapshot.job_repos,
        )
        queue, capped = _fair_queue(requests, kept, snapshot.job_repos, settings, fleet, work)
        placements, policy_blocked = policy.place(queue, fleet, ordered=True)
        work.blocked.extend(policy_blocked)

    stamp = int(now_s)
    admits = tuple(
        Admit(
            job_id=p.request.job.id,
            attempt=p.request.job.run_attempt,
            pool=p.pool,
            nodes=len(p.runner_ids),
            runner_ids=p.runner_ids,
            anchor_id=p.runner_ids[0],
            lease_label=LeaseLabel(p.request.job.id, p.request.job.run_attempt, stamp).render(),
            anchor_labels=tuple(p.request.job.gate_labels()),
            priority=p.request.priority,
            created_at=p.request.job.created_at,
            reason=(
                f"priority {p.request.priority}"
                + (f" ({capped[p.request.job.id]})" if p.request.job.id in capped else "")
                + f", needs {p.request.nodes}: "
                f"{len(p.runner_ids)} free runner(s) of {p.pool or LEGACY}"
            ),
        )
        for p in placements
    )
    return Decisions(
        admit=admits,
        release=tuple(sorted(work.releases, key=lambda r: r.lease_label)),
        clean=tuple(sorted(work.cleans, key=lambda c: c.runner_id)),
        blocked=tuple(work.blocked),
        misconfigured_runners=misconfigured,
        board=_board(runners, facts, fleet),
        notes=tuple(work.notes),
    )


def _original(runner: Runner, folded: Iterable[str]) -> tuple[str, ...]:
    """The runner's own spelling of each folded label, so removal names exactly what is there."""
    spelled = {fold(label): label for label in runner.labels}
    return tuple(sorted(spelled.get(label, label) for label in folded))


def _lease_conflicts(leases: list[Lease], jobs: dict[int, Job]) -> dict[str, str]:
    """Leases that lost to another lease: loser label -> winner label, and where they met.

    Two leases meet on a shared runner, or on their job: one job needs one lease, so a second
    lease of the same job and attempt (two controllers that admitted it at once, each with its
    own nonce) loses even on runners of its own.
    """
    on_runner: dict[int, list[Lease]] = defaultdict(list)
    of_job: dict[tuple[int, int], list[Lease]] = defaultdict(list)
    for lease in leases:
        of_job[(lease.job_id, lease.attempt)].append(lease)
        for rid in lease.runner_ids:
            on_runner[rid].append(lease)

    def rank(lease: Lease) -> tuple[bool, bool, bool, bool, int, str]:
        # running first (the lease its job runs on before a twin), then whole (twins share
        # their anchor and its nodes:N, and a killed admission's twin may hold fewer runners:
        # keeping it would leave the running job short of tokens), then anchored (as the lease
        # protocol's verify step decides), then older; the label (its nonce) breaks a tie
        job = jobs.get(lease.job_id)
        if job is None or job.status != JobStatus.IN_PROGRESS:
            running = runs_here = False
        else:
            running = True
            runs_here = job.runner_id is None or job.runner_id in lease.runner_ids
        short = len(lease.runner_ids) < (lease.requested_nodes or 1)
        return (
            not running,
            not runs_here,
            short,
            lease.anchor_id is None,
            lease.created_at,
            lease.label,
        )

    losers: dict[str, str] = {}
    meetings = [(f"on runner {rid}", on_runner[rid]) for rid in sorted(on_runner)]
    meetings += [(f"of the same job {key[0]}", of_job[key]) for key in sorted(of_job)]
    for where, contenders in meetings:
        if len(contenders) < 2:
            continue
        winner = min(contenders, key=rank)
        for lease in contenders:
            if lease is not winner:
                losers.setdefault(lease.label, f"{winner.label} {where}")
    return losers


def _releases(
    leases: list[Lease],
    jobs: dict[int, Job],
    missing: frozenset[int],
    unreadable: int,
    by_id: dict[int, Runner],
    settings: AdmissionSettings,
    now_s: float,
    work: _Work,
) -> set[str]:
    losers = _lease_conflicts(leases, jobs)
    decided: list[tuple[Lease, ReleaseReason, str]] = []
    for lease in leases:
        job = jobs.get(lease.job_id)
        age = now_s - lease.created_at
        requested = lease.requested_nodes if settings.node_slots else 1
        reason: ReleaseReason | None = None
        detail = ""
        if lease.label in losers:
            reason, detail = ReleaseReason.CONFLICT_LOST, f"lost to {losers[lease.label]}"
        elif job is not None and job.status == JobStatus.COMPLETED:
            reason = ReleaseReason.JOB_FINISHED
            detail = f"job {job.id} completed ({job.conclusion or 'no conclusion'})"
        elif lease.job_id in missing:
            reason, detail = ReleaseReason.JOB_MISSING, f"job {lease.job_id} no longer exists"
        elif lease.anchor_id is None and age > settings.orphan_grace_s:
            reason = ReleaseReason.NO_ANCHOR
            detail = f"no anchor after {age:.0f}s (grace {settings.orphan_grace_s:.0f}s)"
        elif (
            job is not None
            and job.status in NOT_STARTED
            and age > settings.queued_lease_limit_s(job.name)
        ):
            reason = ReleaseReason.EXPIRED_QUEUED
            detail = (
                f"job {job.id} still {job.status} after {age:.0f}s "
                f"(limit {settings.queued_lease_limit_s(job.name):.0f}s)"
            )
        elif (
            job is not None
            and job.status in NOT_STARTED
            and lease.anchor_id is not None
            and requested is not None
            and lease.size < requested
        ):
            reason = ReleaseReason.INCOMPLETE
            detail = f"holds {lease.size} runner(s), its job needs {requested}"
        elif (
            job is not None
            and job.status in NOT_STARTED
            and lease.anchor_id is not None
            and set(lease.anchor_labels) != set(job.gate_labels())
        ):
            # A removal cut short (a killed controller) or a lease label left on another job's
            # anchor: GitHub can never dispatch the job there, so the lease would hold its
            # runners until the queued-lease limit.
            reason = ReleaseReason.INCOMPLETE
            detail = (
                f"anchor {lease.anchor_id} carries {', '.join(lease.anchor_labels)}, not its "
                f"job's {', '.join(job.gate_labels())}"
            )
        elif job is None and lease.job_id not in missing:
            work.notes.append(
                f"lease {lease.label}: job {lease.job_id} is not in the snapshot; kept "
                "(unknown is not gone: the snapshot must look lease jobs up)"
            )
        if reason in _SEEN_BY_RUNNERS and unreadable:
            # The unreadable runner may be this lease's anchor or holder: releasing now could
            # strip the lease off a running job. Judge it on the next full read.
            work.notes.append(
                f"lease {lease.label}: {reason} held back, {unreadable} runner(s) unreadable"
            )
            reason = None
        if reason is not None:
            decided.append((lease, reason, detail))

    released = {lease.label for lease, _, _ in decided}
    # an anchor shared with a kept lease keeps its job labels: they may be the survivor's
    kept_anchors = {
        lease.anchor_id for lease in leases if lease.label not in released and lease.anchor_id
    }
    for lease, reason, detail in decided:
        per_runner: list[tuple[int, tuple[str, ...]]] = []
        for rid in lease.runner_ids:
            remove = [lease.label]
            if rid == lease.anchor_id and rid not in kept_anchors:
                remove.extend(lease.anchor_labels)
            per_runner.append((rid, _original(by_id[rid], remove)))
        job = jobs.get(lease.job_id)
        anchor_id = lease.anchor_id
        if job is not None and _anchors_another_job(lease.anchor_labels, job):
            # A runner two leases share after a crash, anchoring the other's job: GitHub can
            # never dispatch this job there, and its busy flag is the other job's. Judged as
            # this lease's anchor, a busy one kept the lease as "started" for as long as the
            # other job ran.
            anchor_id = None
        work.releases.append(
            Release(
                lease_label=lease.label,
                job_id=lease.job_id,
                pool=lease.pool,
                labels=tuple(per_runner),
                reason=reason,
                detail=detail,
                anchor_id=anchor_id,
                # not known to have started or ended: GitHub may dispatch it while we release
                may_dispatch=lease.job_id not in missing
                and (job is None or job.status not in (JobStatus.IN_PROGRESS, JobStatus.COMPLETED)),
            )
        )
    return released


def _anchors_another_job(anchor_labels: tuple[str, ...], job: Job) -> bool:
    """The anchor carries a `ci-job-*` label, and not the job's (it is unique to a job)."""
    theirs = {fold(label) for label in anchor_labels if fold(label).startswith(JOB_PREFIX)}
    mine = {label for label in job.gate_labels() if label.startswith(JOB_PREFIX)}
    return bool(theirs) and bool(mine) and not theirs & mine


def _cleans(
    runners: list[Runner],
    facts: dict[int, _Facts],
    leases: list[Lease],
    work: _Work,
) -> None:
    anchors = {lease.anchor_id for lease in leases if lease.anchor_id is not None}
    for runner in runners:
        remove: list[str] = []
        reasons: list[str] = []
        known = facts[runner.id]
        bad_leases = [label for label in known.lease_labels if not _valid_lease(label)]
        if bad_leases:
            remove.extend(bad_leases)
            reasons.append("malformed lease label")
        valid_leases = len(bad_leases) < len(known.lease_labels)
        job_labels = known.job_labels
        if job_labels and runner.id not in anchors and not runner.busy:
            remove.extend(job_labels)
            reasons.append(
                "job labels on a non-anchor lease holder"
                if valid_leases
                else "managed job labels on a runner that holds no lease"
            )
        if remove:
            work.cleans.append(Clean(runner.id, _original(runner, remove), "; ".join(reasons)))


def _valid_lease(label: str) -> bool:
    try:
        LeaseLabel.parse(label)
    except LabelError:
        return False
    return True


def _is_free(runner: Runner, known: _Facts) -> bool:
    return (
        runner.online
        and not runner.busy
        and not known.misconfigured
        and not known.lease_labels
        and not known.job_labels
    )


def _fleet_state(
    runners: list[Runner],
    facts: dict[int, _Facts],
    kept: list[Lease],
    settings: AdmissionSettings,
    now_s: float,
) -> FleetState:
    pools: dict[str, PoolState] = {}
    legacy_free: list[int] = []
    legacy_total = 0
    runner_pool: dict[int, str | None] = {}
    label_index: dict[str, set[int]] = defaultdict(set)
    eligible: set[int] = set()
    for runner in runners:
        known = facts[runner.id]
        if known.misconfigured:
            continue
        pool = known.pool
        runner_pool[runner.id] = pool
        eligible.add(runner.id)
        for label in known.folded:
            label_index[label].add(runner.id)
        if pool is None:
            legacy_total += 1
            if _is_free(runner, known):
                legacy_free.append(runner.id)
            continue
        state = pools.get(pool)
        if state is None:
            state = pools[pool] = PoolState(pool, 0, 0, 0, [])
        state.total += 1
        state.online += int(runner.online)
        if _is_free(runner, known):
            state.free.append(runner.id)
    for lease in kept:
        requested = (lease.requested_nodes or 0) if settings.node_slots else 1
        if lease.pool is not None and lease.pool in pools:
            pools[lease.pool].in_use += max(lease.size, requested)
            continue
        # a lease across pools (or on legacy runners) counts each holder in its own pool
        for rid in lease.runner_ids:
            pool = runner_pool.get(rid)
            if pool is not None:
                pools[pool].in_use += 1
    return FleetState(
        pools,
        legacy_free,
        legacy_total,
        runner_pool,
        label_index,
        frozenset(eligible),
        tuple(kept),
        now_s,
        extension_s=settings.overrun_extension_s,
    )


def _running_leases(
    fleet: FleetState,
    kept: list[Lease],
    jobs: dict[int, Job],
    settings: AdmissionSettings,
    estimate: EstimateFn,
) -> None:
    for lease in kept:
        if lease.pool is None or lease.pool not in fleet.pools:
            continue
        requested = (lease.requested_nodes or 0) if settings.node_slots else 1
        nodes = max(lease.size, requested)
        job = jobs.get(lease.job_id)
        if job is None:
            limit = settings.timeout_min * 60.0
            guess = Estimate(limit, limit)
            started = float(lease.created_at)
        else:
            guess = estimate(job, nodes)
            started = job.started_at.timestamp() if job.started_at else fleet.now_s
        fleet.running.setdefault(lease.pool, {})[lease.job_id] = RunningLease(
            lease.job_id, nodes, started, guess
        )


def _fair_queue(
    requests: list[JobRequest],
    kept: list[Lease],
    job_repos: Mapping[int, str],
    settings: AdmissionSettings,
    fleet: FleetState,
    work: _Work,
) -> tuple[list[JobRequest], dict[int, str]]:
    """The queue the policy walks, after the fairness rules (`admission/fairness.py`): scores
    capped at their ceilings, repositories taking turns among equal scores, and the quotas
    set as the fleet's gate. Returns the queue, in order, and the capped jobs' notes."""
    fairness = Fairness.of(settings)
    held = repo_usage(kept, job_repos, settings.node_slots)
    requests, capped = cap_scores(requests, fairness)
    if capped:
        work.notes.append(
            f"score ceilings: {len(capped)} job(s) capped ("
            + "; ".join(f"job {job_id}: {why}" for job_id, why in sorted(capped.items())[:5])
            + (", ..." if len(capped) > 5 else "")
            + ")"
        )
    if fairness.has_quotas:
        fleet.gate = QuotaBook(fairness, held)
    queue = (
        fair_share_order(requests, held, fairness)
        if settings.fair_share
        else priority_order(requests)
    )
    return queue, capped


def _requests(
    jobs: Sequence[Job],
    leases: list[Lease],
    settings: AdmissionSettings,
    work: _Work,
    estimate: EstimateFn,
    skip_queue: frozenset[int] = frozenset(),
    job_repos: Mapping[int, str] | None = None,
) -> list[JobRequest]:
    """The queued managed jobs to place, sized and scored; a job in `skip_queue` (its
    skip-queue label verified by the snapshot read) outranks every score and shows as
    `skip-queue`. An unverified skip-queue label changes nothing: the job keeps its score."""
    leased = {(lease.job_id, lease.attempt) for lease in leases}
    requests: list[JobRequest] = []
    for job in sorted(jobs, key=lambda j: j.id):
        if job.status != JobStatus.QUEUED:
            continue
        if not job.gate_labels():
            work.notes.append(
                f"job {job.id} ({job.name}) has no ci-job/ci-attempt/nodes label: left to GitHub"
            )
            continue
        if (job.id, job.run_attempt) in leased:
            continue
        try:
            check_managed_ascii(job.labels)
            nodes = parse_nodes(job.labels) if settings.node_slots else 1
            score = _score(job, settings.default_priority)
        except LabelError as exc:
            work.blocked.append(Blocked(job.id, None, None, BlockReason.BAD_INPUT, str(exc)))
            continue
        skips = job.id in skip_queue
        requests.append(
            JobRequest(
                job,
                nodes,
                score,
                SKIP_QUEUE_PRIORITY if skips else f"{score:.3f}",
                unmanaged(job.labels),
                estimate(job, nodes),
                skip_queue=skips,
                repo=(job_repos or {}).get(job.id),
            )
        )
    return requests


def _score(job: Job, default: Decimal) -> Decimal:
    """The job's ci-job-<score> score; among skip-queue jobs it still orders them."""
    labels = [label for label in job.labels if fold(label).startswith(JOB_PREFIX)]
    if not labels:
        return default
    if len(labels) > 1:
        raise LabelError(
            f"job has {len(labels)} ci-job labels ({', '.join(labels)}); keep exactly one"
        )
    return JobLabel.parse(labels[0]).score


def _board(
    runners: list[Runner], facts: dict[int, _Facts], fleet: FleetState
) -> tuple[PoolRow, ...]:
    """One row per pool, after this plan's admissions; `admitted_nodes` is the in-use count."""
    rows: list[PoolRow] = []
    per_pool: dict[str | None, list[Runner]] = defaultdict(list)
    leased: set[int] = set()
    for runner in runners:
        known = facts[runner.id]
        if known.lease_labels:
            leased.add(runner.id)
        if not known.misconfigured:
            per_pool[known.pool].append(runner)
    for name in sorted(fleet.pools):
        state = fleet.pools[name]
        members = per_pool[name]
        leases = {label for r in members for label in facts[r.id].lease_labels}
        cordon = ""
        if state.cordoned is not None:
            left = f"draining, {len(leases)} lease(s) left" if leases else "drained"
            cordon = f"cordoned ({state.cordoned}): {left}"
        rows.append(
            PoolRow(
                pool=name,
                runners=state.total,
                online=state.online,
                leased=sum(1 for r in members if r.id in leased),
                busy_unleased=sum(1 for r in members if r.busy and r.id not in leased),
                free=len(state.free),
                admitted_nodes=state.in_use,
                blocked=state.blocked,
                slurm=state.slurm.summary() if state.slurm is not None else "",
                cordon=cordon,
                leases=len(leases),
                slurm_usable=state.slurm.usable if state.slurm is not None else None,
                slurm_total=state.slurm.total if state.slurm is not None else None,
            )
        )
    legacy = per_pool.get(None, [])
    if legacy:
        rows.append(
            PoolRow(
                pool=LEGACY,
                runners=len(legacy),
                online=sum(1 for r in legacy if r.online),
                leased=sum(1 for r in legacy if r.id in leased),
                busy_unleased=sum(1 for r in legacy if r.busy and r.id not in leased),
                free=len(fleet.legacy_free),
                admitted_nodes=sum(1 for r in legacy if r.id in leased) + fleet.legacy_admitted,
                blocked=0,
            )
        )
    rows.sort(key=lambda row: row.pool)
    return tuple(rows)
