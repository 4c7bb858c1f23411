"""The discrete-event replay: jobs arrive, the planner's policy admits, leases end on time.

Two drivers share the planner's policies, fit and reservation code:

- `simulate` keeps one `FleetState` across events and calls the policy directly (the hot path
  of `plan()` without re-reading labels), fast enough for whole traces;
- `simulate_via_plan` builds a label-encoded `Snapshot` at every event, calls `plan()` twice
  (releases, then admissions on a fresh read, as the reconcile flow does) and applies its
  decisions to the runners' labels. It is slow, and exists to prove both give the same schedule.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypedDict, Unpack

from pydantic import ValidationError

from slurmgate.admission.capacity import FleetState, JobRequest, PoolState
from slurmgate.admission.estimates import Estimate, Estimator, RuntimeHistory
from slurmgate.admission.labels import fold
from slurmgate.admission.model import Job, JobStatus, Runner, Snapshot
from slurmgate.admission.planner import plan
from slurmgate.admission.policies import (
    SIMULATED_POLICY_NAMES,
    AdmissionPolicy,
    policy_for,
    priority_key,
)
from slurmgate.errors import InputError
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.simulator.metrics import Run, summarize
from slurmgate.simulator.traces import Trace, TraceJob

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
EPOCH_S = EPOCH.timestamp()  # trace time 0 in the unix seconds the planner works in
ESTIMATES = ("timeout", "learned", "perfect")


class SimulationError(InputError):
    """Bad simulator input; the message names the option and the fix."""


@dataclass(frozen=True, slots=True)
class Result:
    runs: tuple[Run, ...]
    rejected: tuple[int, ...]
    pools: dict[str, int]
    policy: str
    estimates: str
    plans: int  # how many times the policy decided

    def metrics(self, wide_frac: float = 0.25) -> dict[str, Any]:
        wide_above = wide_frac * max(self.pools.values())
        out = summarize(self.runs, sum(self.pools.values()), wide_above, len(self.rejected))
        out.update(policy=self.policy, estimates=self.estimates, pools=dict(self.pools))
        return out


def controller_settings(**overrides: Any) -> AdmissionSettings:
    """The controller's own defaults (AdmissionSettings' field defaults: its policy, estimates
    and reservation trigger) with both seed flags on and the knobs as given; the environment is
    not read, so a replay does not depend on the shell it runs in."""
    values: dict[str, Any] = {
        "PRIORITY_SCHEDULER_ENABLED": True,
        "NODE_SLOT_SCHEDULER_ENABLED": True,
    }
    values.update(overrides)
    return AdmissionSettings.model_validate(values)


POLICY_KNOBS = (
    "policy",
    "estimates",
    "timeout_min",
    "timeout_overrides",
    "estimate_quantile",
    "estimate_min_samples",
    "overrun_extension_s",
    "reserve_after_s",
    "wide_fraction",
    "reservation_depth",
)
"""The settings a replay's schedule depends on."""


def replay_settings(flags: dict[str, Any]) -> AdmissionSettings:
    """`controller_settings` with the settings a command's flags gave; a bad value is a
    SimulationError naming the flag (`reserve_after_s` is the --reserve-after flag, in hours)."""
    try:
        return controller_settings(**flags)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        flag = "--reserve-after" if field == "reserve_after_s" else "--" + field.replace("_", "-")
        value = flags.get(field)
        if field == "reserve_after_s" and isinstance(value, int | float):
            value = value / 3600
        raise SimulationError(f"{flag} {value!r}: {error['msg']}") from None


def replay_knobs(settings: AdmissionSettings, policy: str, estimates: str) -> dict[str, Any]:
    """The POLICY_KNOBS a replay ran with, as JSON values (policy and estimates as replayed)."""
    knobs = settings.model_dump(mode="json", include=set(POLICY_KNOBS))
    knobs.update(policy=policy, estimates=estimates)
    return knobs


def sim_settings(**overrides: Any) -> AdmissionSettings:
    """Settings for a classic replay: the controller's defaults but immediate reservations for
    every job (classic EASY: reserve_after_s 0, no wide fraction), and the knobs as given; the
    environment is not read."""
    return controller_settings(**{"reserve_after_s": 0.0, "wide_fraction": None, **overrides})


def parse_pools(spec: str | None, trace: Trace) -> tuple[dict[str, int], bool]:
    """`100,32` (anonymous pools p0, p1, ...: any job may use any) or `name=size,...`.

    Returns the pools and whether jobs are bound to their own pool (the job mix). Without a
    spec, the trace's own pools are used (the job mix has them; an SWF log does not).
    """
    if not spec:
        if trace.pools is None:
            raise SimulationError(
                "--pools is required for an SWF trace: give node counts, e.g. --pools 100"
            )
        return dict(trace.pools), True
    pools: dict[str, int] = {}
    named = False
    for index, part in enumerate(p.strip() for p in spec.split(",")):
        name, _, size = part.rpartition("=")
        try:
            count = int(size)
        except ValueError:
            count = 0
        if count < 1:
            raise SimulationError(
                f"--pools entry {part!r} is not a positive node count; write e.g. 100,32 "
                "or cluster:a=10,cluster:b=18"
            )
        if name:
            named = True
            name = name if name.startswith("cluster:") else f"cluster:{name}"
        else:
            name = f"cluster:p{index}"
        pools[fold(name)] = count
    if named and trace.pools is None:
        raise SimulationError("named --pools need a trace that names pools (the job-mix CSV)")
    return pools, named


def _job(t: TraceJob, pool: str | None, score: Decimal) -> Job:
    labels = ["self-hosted"]
    if pool is not None:
        labels.append(pool)
    labels += [f"ci-job-{score:.3f}-t{t.id}", "ci-attempt-1", f"nodes:{t.nodes}"]
    return Job(
        id=t.id,
        run_id=t.id,
        run_attempt=1,
        name=t.name or f"job-{t.id}",
        labels=tuple(labels),
        status=JobStatus.QUEUED,
        created_at=EPOCH + timedelta(seconds=t.submit_s),
    )


class _Estimates:
    """Per-job estimates as the replay knows them: limit, perfect, or learned online."""

    def __init__(self, source: str, settings: AdmissionSettings) -> None:
        if source not in ESTIMATES:
            raise SimulationError(f"--estimates {source!r} is not one of {', '.join(ESTIMATES)}")
        self.source = source
        self.history = RuntimeHistory(keep=20)
        self.estimator = Estimator(
            "learned" if source == "learned" else "timeout",
            settings.estimate_quantile,
            settings.estimate_min_samples,
            self.history,
        )

    def of(self, t: TraceJob) -> Estimate:
        if self.source == "perfect":
            return Estimate(t.runtime_s, t.runtime_s)
        return self.estimator.estimate(t.key, t.limit_s)

    def completed(self, t: TraceJob, end_s: float) -> None:
        if self.source == "learned":
            self.history.record(t.key, t.id, t.runtime_s, end_s)


def _prepare(
    trace: Trace, pools: dict[str, int], bound: bool
) -> tuple[list[tuple[TraceJob, str | None, Decimal]], list[int]]:
    """Each job with its pool requirement and score; jobs that fit no pool are rejected."""
    largest = max(pools.values())
    accepted: list[tuple[TraceJob, str | None, Decimal]] = []
    rejected: list[int] = []
    for rank, t in enumerate(trace.jobs):
        pool = fold(t.pool) if bound and t.pool else None
        room = pools.get(pool, 0) if pool is not None else largest
        if t.nodes > room:
            rejected.append(t.id)
            continue
        score = t.score if t.score is not None else Decimal(-rank)
        accepted.append((t, pool, score))
    return accepted, rejected


def simulate(
    trace: Trace,
    pools: dict[str, int],
    policy: str | AdmissionPolicy,
    *,
    estimates: str = "timeout",
    bound: bool = False,
    settings: AdmissionSettings | None = None,
) -> Result:
    """Replay `trace` on `pools` with the planner's `policy` (or a simulator candidate's
    policy object); the fast driver."""
    settings = settings or sim_settings()
    if isinstance(policy, AdmissionPolicy):
        chosen, policy = policy, policy.name
    elif policy in SIMULATED_POLICY_NAMES:
        chosen = policy_for(settings, policy)
    else:
        choices = ", ".join(SIMULATED_POLICY_NAMES)
        raise SimulationError(f"--policy {policy!r} is not one of {choices}")
    known = _Estimates(estimates, settings)
    accepted, rejected = _prepare(trace, pools, bound)

    states: dict[str, PoolState] = {}
    runner_pool: dict[int, str | None] = {}
    index: dict[str, set[int]] = {}
    rid = 1
    for name, size in pools.items():
        ids = list(range(rid, rid + size))
        states[name] = PoolState(name, size, size, 0, ids)
        index[name] = set(ids)
        runner_pool.update(dict.fromkeys(ids, name))
        rid += size
    fleet = FleetState(
        states,
        [],
        0,
        runner_pool,
        index,
        frozenset(runner_pool),
        extension_s=settings.overrun_extension_s,
    )

    queue: list[JobRequest] = []
    by_id: dict[int, TraceJob] = {}
    running: list[tuple[float, int, str, tuple[int, ...]]] = []
    runs: list[Run] = []
    plans = 0
    arrivals = iter(accepted)
    upcoming = next(arrivals, None)
    while upcoming is not None or running:
        now = min(
            upcoming[0].submit_s if upcoming is not None else float("inf"),
            running[0][0] if running else float("inf"),
        )
        while running and running[0][0] <= now:
            end, job_id, pool, runner_ids = heapq.heappop(running)
            fleet.finish(pool, job_id, runner_ids)
            known.completed(by_id.pop(job_id), end)
        while upcoming is not None and upcoming[0].submit_s <= now:
            t, pool_name, score = upcoming
            by_id[t.id] = t
            request = JobRequest(
                _job(t, pool_name, score),
                t.nodes,
                score,
                f"{score:.3f}",
                frozenset({pool_name}) if pool_name else frozenset(),
                known.of(t),
            )
            bisect.insort(queue, request, key=priority_key)
            upcoming = next(arrivals, None)
        if not queue:
            continue
        fleet.now_s = EPOCH_S + now
        placements, _ = chosen.place(queue, fleet, ordered=True, explain=False)
        plans += 1
        if not placements:
            continue
        placed = set()
        for p in placements:
            t = by_id[p.request.job.id]
            placed.add(t.id)
            assert p.pool is not None
            heapq.heappush(running, (now + t.runtime_s, t.id, p.pool, p.runner_ids))
            runs.append(Run(t.id, t.submit_s, now, t.runtime_s, t.nodes, p.pool, p.runner_ids))
        queue = [r for r in queue if r.job.id not in placed]
    return Result(tuple(runs), tuple(rejected), dict(pools), policy, estimates, plans)


class ReplayOptions(TypedDict, total=False):
    """The options both replay drivers take besides the trace, the pools and the policy."""

    estimates: str
    bound: bool
    settings: AdmissionSettings | None


def simulate_via_plan(
    trace: Trace, pools: dict[str, int], policy: str, **options: Unpack[ReplayOptions]
) -> Result:
    """Replay through `plan()` itself: runners carry lease labels, jobs carry gate labels.

    Slow (a whole plan per event); it checks that `simulate`, which drives the same policies on
    a long-lived fleet, replays what the planner would do.
    """
    if policy == "fcfs":
        raise SimulationError("fcfs is a simulator baseline, not a planner policy: use simulate()")
    estimates, bound = options.get("estimates", "timeout"), options.get("bound", False)
    settings = (options.get("settings") or sim_settings()).model_copy(update={"policy": policy})
    known = _Estimates(estimates, settings)
    accepted, rejected = _prepare(trace, pools, bound)
    runners: dict[int, Runner] = {}
    rid = 1
    for name, size in pools.items():
        for _ in range(size):
            runners[rid] = Runner(rid, f"r{rid}", True, False, ("self-hosted", name))
            rid += 1
    trace_of: dict[int, TraceJob] = {}
    fixed: dict[int, Estimate] = {}
    jobs: dict[int, Job] = {}
    ends: list[tuple[float, int]] = []
    runs: list[Run] = []
    plans = 0

    def estimate(job: Job, nodes: int) -> Estimate:
        return fixed[job.id]

    def decide(now: float) -> Any:
        nonlocal plans
        plans += 1
        snap = Snapshot(tuple(runners.values()), tuple(jobs.values()), EPOCH)
        return plan(snap, settings, EPOCH + timedelta(seconds=now), estimate=estimate)

    pending = list(accepted)
    pending.reverse()
    while pending or ends:
        now = min(
            pending[-1][0].submit_s if pending else float("inf"),
            ends[0][0] if ends else float("inf"),
        )
        finished = False
        while ends and ends[0][0] <= now:
            end, job_id = heapq.heappop(ends)
            jobs[job_id] = replace(jobs[job_id], status=JobStatus.COMPLETED, completed_at=EPOCH)
            known.completed(trace_of[job_id], end)
            finished = True
        while pending and pending[-1][0].submit_s <= now:
            t, pool_name, score = pending.pop()
            trace_of[t.id] = t
            fixed[t.id] = known.of(t)
            jobs[t.id] = _job(t, pool_name, score)
        if finished:
            for release in decide(now).release:
                for rid, remove in release.labels:
                    drop = {fold(x) for x in remove}
                    kept = tuple(x for x in runners[rid].labels if fold(x) not in drop)
                    runners[rid] = replace(runners[rid], labels=kept)
                jobs.pop(release.job_id, None)
        if not any(j.status == JobStatus.QUEUED for j in jobs.values()):
            continue
        for admit in decide(now).admit:
            for rid in admit.runner_ids:
                extra: tuple[str, ...] = (admit.lease_label,)
                if rid == admit.anchor_id:
                    extra += admit.anchor_labels
                runners[rid] = replace(runners[rid], labels=(*runners[rid].labels, *extra))
            t = trace_of[admit.job_id]
            jobs[t.id] = replace(
                jobs[t.id],
                status=JobStatus.IN_PROGRESS,
                started_at=EPOCH + timedelta(seconds=now),
                runner_id=admit.anchor_id,
            )
            heapq.heappush(ends, (now + t.runtime_s, t.id))
            assert admit.pool is not None
            runs.append(
                Run(t.id, t.submit_s, now, t.runtime_s, t.nodes, admit.pool, admit.runner_ids)
            )
    return Result(tuple(runs), tuple(rejected), dict(pools), policy, estimates, plans)
