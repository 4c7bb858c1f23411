"""The reconcile tick: read, plan, release, clean, re-plan on freed capacity, admit in order.

`reconcile_tick` holds the algorithm; how each step talks to GitHub is injected, the way
`leases.Admission` takes its steps. The Prefect flow passes retried tasks (one `lease` task
per admission), `slurmgate status` passes only a read, and the benchmark passes the bare core
protocol, so all three do the same work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from slurmgate.admission.batch_verify import (
    BUDGET_SHARE,
    ROUND_WAIT_SHARE,
    BatchShare,
    BatchVerification,
    verification_batches,
)
from slurmgate.admission.capacity import CapacityUnread, NodeCapacity
from slurmgate.admission.estimates import RuntimeHistory
from slurmgate.admission.labels import LeaseLabel, new_nonce
from slurmgate.admission.leases import (
    AdmitOutcome,
    ReadDispatch,
    RemoveLabels,
    anchor_window_s,
    release_lease,
)
from slurmgate.admission.model import Admit, Blocked, Clean, Decisions, Release, Snapshot
from slurmgate.admission.planner import plan
from slurmgate.errors import ExternalError, one_line
from slurmgate.settings.admission import AdmissionSettings

ReadSnapshot = Callable[[], Awaitable[Snapshot]]
AdmitJob = Callable[[Admit, int, BatchShare], Awaitable[AdmitOutcome]]
"""One admission: the admit, the fleet size, and what its batch shares with it (the
verification, the anchor deadline); pass those on to `leases.admit_lease` or `LeaseSteps`."""
ReadCapacity = Callable[[], Awaitable[Mapping[str, NodeCapacity]]]
"""What Slurm says of each mapped pool's partition (`slurm/capacity.py` reads it)."""


class TickLog(Protocol):
    """The slice of a `logging.Logger` the tick writes to (Prefect's run logger is one)."""

    def info(self, msg: str, *args: Any) -> None: ...

    def warning(self, msg: str, *args: Any) -> None: ...


class _Silent:
    def info(self, msg: str, *args: Any) -> None:
        return None

    def warning(self, msg: str, *args: Any) -> None:
        return None


@dataclass(frozen=True)
class TickSteps:
    """How the tick reads and writes. Without `remove` and `admit` it only reads and plans.

    `read_dispatch` re-reads a lease's job and anchor right before a release of a job that may
    still be dispatched (`leases.release_lease`); without it such a release is not re-checked.
    `read_capacity` reads Slurm's nodes for the pools mapped to partitions, with every snapshot
    read; without it (or when it fails: fail-open, one warning a tick) capacity is runners only.
    `write_interval_s` is how far apart the client sends writes: admissions are verified in
    batches whose writes fit well inside the anchor deadline at that pace.
    """

    read_snapshot: ReadSnapshot
    remove: RemoveLabels | None = None
    admit: AdmitJob | None = None
    read_dispatch: ReadDispatch | None = None
    read_capacity: ReadCapacity | None = None
    write_interval_s: float = 0.0  # the client's write pacing, which sizes verification batches

    @property
    def read_only(self) -> bool:
        return self.remove is None and self.admit is None


class TickFailed(ExternalError):
    """Some decisions of the tick failed after their retries; the rest were carried out."""


@dataclass
class TickReport:
    """What one tick did. `decisions` is the plan the admissions came from (the board)."""

    decisions: Decisions
    fleet_size: int
    admitted: int = 0
    rolled_back: int = 0
    released: int = 0
    kept_started: int = 0
    cleaned: int = 0
    plan_s: float = 0.0
    runtimes_learned: int = 0
    failures: list[str] = field(default_factory=list)
    anchored: list[Admit] = field(default_factory=list)  # the admissions that were anchored

    @property
    def blocked(self) -> int:
        return len(self.decisions.blocked)

    def counts(self) -> dict[str, Any]:
        """The tick's numbers, as the flow returns and logs them."""
        return {
            "admitted": self.admitted,
            "rolled_back": self.rolled_back,
            "released": self.released,
            "kept_started": self.kept_started,
            "cleaned": self.cleaned,
            "blocked": self.blocked,
            "errors": len(self.failures),
            "plan_s": self.plan_s,
        }

    def raise_for_failures(self) -> None:
        if self.failures:
            raise TickFailed(
                f"{len(self.failures)} decision(s) failed after retries (the next tick repairs "
                "them): " + "; ".join(self.failures)
            )


def _now() -> datetime:
    return datetime.now(UTC)


async def reconcile_tick(
    steps: TickSteps,
    settings: AdmissionSettings,
    *,
    history: RuntimeHistory | None = None,
    log: TickLog | None = None,
    now: Callable[[], datetime] = _now,
    nonce: Callable[[], str] = new_nonce,
) -> TickReport:
    """One tick. A failed release, clean or admission is collected, never raised: the others
    still run, and the report's `failures` name what the next tick must repair.

    With `history`, the finished lease jobs of the snapshot are learned into it first
    (`runtimes_learned` counts the new runtimes: the caller saves them). `nonce` draws each
    admission's lease nonce (random; a test that compares two ticks' writes fixes it).
    """
    log = log or _Silent()
    for warning in settings.flag_warnings:
        log.warning("settings %s", warning)
    # Ages are judged as of when the read began: a lease the read saw without its anchor was
    # anchorless at some moment after that, never later than it. Judged at plan time instead, a
    # slow read would let a lease another controller anchored meanwhile pass the orphan grace.
    read_at = now()
    snapshot = await steps.read_snapshot()
    for repo, why in snapshot.unread_repos:  # every tick: the others are admitted meanwhile
        log.warning(
            "repository %s unread (%s): its queued jobs wait, its leases are kept; fix its "
            "name in the scope's repos, or grant the App access to it",
            repo,
            why,
        )
    slurm = _Capacity(steps.read_capacity, log)
    learned = history.learn(snapshot.jobs, settings.node_slots) if history is not None else 0
    decisions, plan_s = _timed_plan(snapshot, settings, history, lambda: read_at, await slurm())
    report = TickReport(decisions, len(snapshot.runners), plan_s=plan_s, runtimes_learned=learned)
    log_removals(decisions, log)
    if steps.remove is not None:
        await _remove(steps.remove, steps.read_dispatch, decisions, report, log)
    if report.released or report.cleaned:
        # Freed runners still carried their labels in the first read; admit from a fresh read
        # so released capacity is reused in this tick, never guessed at.
        read_at = now()
        snapshot = await steps.read_snapshot()
        decisions, plan_s = _timed_plan(snapshot, settings, history, lambda: read_at, await slurm())
        report.decisions, report.fleet_size = decisions, len(snapshot.runners)
        report.plan_s += plan_s
        for deferred in (*decisions.release, *decisions.clean):
            log.info("deferred to the next tick: %s", deferred)
    log_admissions(decisions, log)
    if steps.admit is not None:
        # Batches one after another, a batch's admissions side by side: their runners are
        # disjoint, and one fresh read verifies them all (`batch_verify.py`).
        window = anchor_window_s(settings.orphan_grace_s)
        budget = window * BUDGET_SHARE
        for batch in verification_batches(decisions.admit, steps.write_interval_s, budget_s=budget):
            # Stamped now, not at plan time: the orphan grace and the anchor deadline then
            # measure this batch's own protocol, not the batches before it.
            at = now()
            stamped = [restamped(planned, at, nonce()) for planned in batch]
            verifier = (
                BatchVerification(
                    stamped, report.fleet_size, round_wait_s=window * ROUND_WAIT_SHARE
                )
                if len(batch) > 1
                else None
            )
            await _admit_batch(steps.admit, stamped, report, BatchShare(verifier, window))
    return report


async def _admit_batch(
    admit: AdmitJob,
    batch: list[Admit],
    report: TickReport,
    share: BatchShare,
) -> None:
    verifier = share.verifier

    async def one(planned: Admit) -> AdmitOutcome:
        try:
            return await admit(planned, report.fleet_size, share)
        finally:
            if verifier is not None:
                verifier.leave(planned)  # ended, verified or not: the batch's read waits no more

    outcomes = await asyncio.gather(*(one(planned) for planned in batch), return_exceptions=True)
    for planned, outcome in zip(batch, outcomes, strict=True):
        if isinstance(outcome, AdmitOutcome):
            if outcome.admitted:
                report.admitted += 1
                report.anchored.append(planned)
            else:
                report.rolled_back += 1
        elif isinstance(outcome, Exception):
            report.failures.append(f"lease {planned.lease_label}: {one_line(outcome)}")
        else:
            raise outcome  # cancelled, interrupted: the tick stops (each admission unwound)


def restamped(admit: Admit, at: datetime, nonce: str | None = None) -> Admit:
    """The admission with its lease label stamped `at` (never earlier than the plan's stamp)
    and given a nonce (the label's own if it has one, else `nonce`, else a fresh one): two
    controllers admitting one job in the same second then write two leases, which the
    planner's conflict rule tells apart."""
    planned = LeaseLabel.parse(admit.lease_label)
    stamp = max(planned.created_at, int(at.timestamp()))
    chosen = planned.nonce or nonce or new_nonce()
    label = LeaseLabel(planned.job_id, planned.attempt, stamp, chosen)
    return replace(admit, lease_label=label.render())


class _Capacity:
    """The tick's Slurm capacity reads: fail-open (runner-only capacity) with one warning a
    tick. Only this read fails open; the lease protocol never does. After a failure the tick
    does not ask again (a controller that times out would stall every re-read)."""

    def __init__(self, read: ReadCapacity | None, log: TickLog) -> None:
        self.read = read
        self.log = log
        self.warned: set[str] = set()

    async def __call__(self) -> Mapping[str, NodeCapacity] | None:
        if self.read is None:
            return None
        try:
            return await self.read()
        except CapacityUnread as exc:
            # several clusters: the ones that answered stand, each unread one fails open alone
            for name, (why, pools) in sorted(exc.unread.items()):
                if name not in self.warned:
                    self.warned.add(name)
                    self.log.warning(
                        "slurm capacity of cluster %s unread (%s): its pools (%s) count "
                        "runners only this tick",
                        name,
                        why,
                        ", ".join(pools),
                    )
            return exc.capacity
        except Exception as exc:
            self.read = None
            self.log.warning(
                "slurm capacity unread (%s): this tick counts runners only", one_line(exc)
            )
            return None


def _timed_plan(
    snapshot: Snapshot,
    settings: AdmissionSettings,
    history: RuntimeHistory | None,
    now: Callable[[], datetime],
    slurm: Mapping[str, NodeCapacity] | None = None,
) -> tuple[Decisions, float]:
    started = time.perf_counter()
    decisions = plan(snapshot, settings, now(), history=history, slurm=slurm)
    return decisions, round(time.perf_counter() - started, 6)


async def _remove(
    remove: RemoveLabels,
    read_dispatch: ReadDispatch | None,
    decisions: Decisions,
    report: TickReport,
    log: TickLog,
) -> None:
    for release in decisions.release:
        try:
            outcome = await release_lease(release, remove, read_dispatch)
        except Exception as exc:
            report.failures.append(f"release {release.lease_label}: {one_line(exc)}")
            continue
        if outcome.released:
            report.released += 1
        else:
            report.kept_started += 1
            log.info("kept job=%s lease=%s %s", release.job_id, release.lease_label, outcome.reason)
    for clean in decisions.clean:
        try:
            await remove(((clean.runner_id, clean.labels),))
            report.cleaned += 1
        except Exception as exc:
            report.failures.append(f"clean runner {clean.runner_id}: {one_line(exc)}")


def log_removals(decisions: Decisions, log: TickLog) -> None:
    """One line per release and clean: job id, lease id, pool and the reason."""
    removals: list[Release | Clean] = [*decisions.release, *decisions.clean]
    for removal in removals:
        log.info("%s", removal.line())


def log_admissions(decisions: Decisions, log: TickLog) -> None:
    """One line per admit and blocked job, misconfigured runner and planner note."""
    decided: list[Admit | Blocked] = [*decisions.admit, *decisions.blocked]
    for decision in decided:
        log.info("%s", decision.line())
    for runner_id, why in decisions.misconfigured_runners:
        log.warning("misconfigured runner=%s %s", runner_id, why)
    for note in decisions.notes:
        log.info("note %s", note)
