"""The lease protocol: label N runners, re-read and verify, anchor in one write; undo on failure.

Every step is a plain async function over a GitHub client, idempotent so that a retry after a
write that did land is harmless. Each write registers its undo on a `CompensationStack` *before*
it is sent (a write that timed out may still have landed), and a failed admission unwinds the
stack in reverse: it removes exactly the labels this attempt added and nothing else.

Removal is here too: `remove_labels` for any managed labels, and `release_lease` for a lease
whose job GitHub may dispatch while it is being released (re-read, dispatch gate first).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from slurmgate.admission.labels import (
    LabelError,
    LeaseLabel,
    fold,
    is_anchor_label,
    is_managed,
)
from slurmgate.admission.model import NOT_STARTED, Admit, Job, JobStatus, Release, Runner
from slurmgate.errors import ExternalError, InputError, NotFoundError, is_transient


class LeaseClient(Protocol):
    """The slice of the GitHub client the protocol uses; a runner that is gone is NotFoundError."""

    async def list_runners(self, conditional: bool = True) -> list[Runner]: ...

    async def get_runner(self, runner_id: int) -> Runner: ...

    async def add_labels(self, runner_id: int, labels: list[str]) -> object: ...

    async def remove_label(self, runner_id: int, label: str) -> bool: ...


class LeaseError(ExternalError):
    """An admission that must be rolled back; never retried (the fleet said no)."""


class LeaseConflict(LeaseError):
    """Another lease holds one of the chosen runners and wins the deterministic rule."""


class LeaseLost(LeaseError):
    """A chosen runner vanished, went offline or busy, or lost our label before the anchor."""


class AlreadyRunning(LeaseError):
    """The job already runs under this exact lease label (a twin admission wrote it): the
    labels stay, since they are the running job's lease, and nothing more is written."""


class UnmanagedLabelError(InputError):
    """A release or clean asked to remove a label slurmgate does not own."""


# ---- compensation ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Undo:
    """One registered compensation: what it undoes, and the call that undoes it."""

    runner_id: int
    label: str
    action: Callable[[], Awaitable[object]]


@dataclass(slots=True)
class UnwindReport:
    """What compensation removed, and what it could not (the next reconcile repairs those)."""

    undone: list[tuple[int, str]] = field(default_factory=list)
    failed: list[tuple[int, str, str]] = field(default_factory=list)


class CompensationStack:
    """Undo actions registered before each write, unwound in reverse when the attempt fails."""

    def __init__(self, *, undo_attempts: int = 3, undo_backoff_s: float = 0.2) -> None:
        self._undos: list[Undo] = []
        self._landed: set[tuple[int, str]] = set()
        self._undo_attempts = undo_attempts
        self._undo_backoff_s = undo_backoff_s

    def __len__(self) -> int:
        return len(self._undos)

    @property
    def pending(self) -> list[tuple[int, str]]:
        return [(undo.runner_id, undo.label) for undo in self._undos]

    def push_label_removal(self, client: LeaseClient, runner_id: int, label: str) -> None:
        """Register the removal of `label` from `runner_id`; only managed labels are allowed."""
        if not is_managed(label):
            raise UnmanagedLabelError(
                f"refusing to register removal of {label!r}: only ci-lease-*, ci-job-*, "
                "ci-attempt-* and nodes:* labels are ever removed"
            )
        if (runner_id, fold(label)) in {(u.runner_id, fold(u.label)) for u in self._undos}:
            return  # a retried step registers once; the label is removed once

        async def remove() -> bool:
            return await client.remove_label(runner_id, label)

        self._undos.append(Undo(runner_id, label, remove))

    def mark_landed(self, runner_id: int, label: str) -> None:
        """GitHub confirmed this write: a retried step need not send it again."""
        self._landed.add((runner_id, fold(label)))

    def landed(self, runner_id: int, label: str) -> bool:
        return (runner_id, fold(label)) in self._landed

    def commit(self) -> None:
        """The attempt succeeded: forget the undos."""
        self._undos.clear()
        self._landed.clear()

    async def unwind(self) -> UnwindReport:
        """Run every undo in reverse order; never raises for a failed undo, it reports it."""
        report = UnwindReport()
        self._landed.clear()
        while self._undos:
            undo = self._undos.pop()
            for attempt in range(1, self._undo_attempts + 1):
                try:
                    await undo.action()
                except Exception as exc:
                    if attempt < self._undo_attempts and is_transient(exc):
                        await asyncio.sleep(self._undo_backoff_s * attempt)
                        continue
                    report.failed.append((undo.runner_id, undo.label, type(exc).__name__))
                    break
                report.undone.append((undo.runner_id, undo.label))
                break
        return report


# ---- the protocol steps ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verification:
    """The re-read fleet confirmed the lease; `anchor_present` are anchor labels it already had."""

    anchor_present: frozenset[str]


async def add_lease_label(
    client: LeaseClient, admit: Admit, runner_id: int, stack: CompensationStack
) -> None:
    """Step 1, one runner: add the shared lease label (one POST; adding it twice is harmless)."""
    if runner_id not in admit.runner_ids:
        raise ValueError(f"runner {runner_id} is not one of lease {admit.lease_label}'s runners")
    if stack.landed(runner_id, admit.lease_label):
        return  # a retried step: this write was confirmed earlier in the same attempt
    stack.push_label_removal(client, runner_id, admit.lease_label)
    await client.add_labels(runner_id, [admit.lease_label])
    stack.mark_landed(runner_id, admit.lease_label)


async def add_lease_labels(client: LeaseClient, admit: Admit, stack: CompensationStack) -> None:
    """Step 1: the lease label on every chosen runner, one write each, in runner order.

    Retrying the step re-sends only the writes not yet confirmed in this attempt, so a
    transient fault costs one extra write, not N.
    """
    for runner_id in admit.runner_ids:
        await add_lease_label(client, admit, runner_id, stack)


def _created(label: str) -> int:
    try:
        return LeaseLabel.parse(label).created_at
    except LabelError:
        return 0  # a malformed lease label is the oldest: it never beats a well-formed one


def check_lease(admit: Admit, fleet: Sequence[Runner]) -> Verification:
    """Step 2 on a fleet already read: raise LeaseLost/LeaseConflict, or confirm the lease."""
    if admit.anchor_id not in admit.runner_ids:
        raise ValueError(
            f"Admit for job {admit.job_id}: anchor_id {admit.anchor_id} is not one of runner_ids"
        )
    ours = fold(admit.lease_label)
    by_id = {r.id: r for r in fleet}
    for runner_id in admit.runner_ids:
        runner = by_id.get(runner_id)
        if runner is None:
            raise LeaseLost(f"runner {runner_id} is no longer registered")
        if ours not in runner.lease_labels:
            raise LeaseLost(f"runner {runner.name} ({runner_id}) no longer carries {ours}")
        if not runner.online:
            raise LeaseLost(f"runner {runner.name} ({runner_id}) went offline")
        if runner.busy:
            alone = runner.lease_labels == [ours]  # another label there may be what it runs under
            if alone and {fold(label) for label in admit.anchor_labels} <= runner.folded:
                # Our lease label and our job's own labels on a busy runner: another admission
                # wrote the very same label (an older controller without the nonce, in the same
                # second), and GitHub runs the job. Unwinding would strip that lease off it.
                raise AlreadyRunning(
                    f"job {admit.job_id} already runs on runner {runner.name} ({runner_id}) "
                    f"under {ours}, written by another admission"
                )
            raise LeaseLost(f"runner {runner.name} ({runner_id}) is busy with another job")
        others = sorted(label for label in runner.lease_labels if label != ours)
        if others:
            # GitHub has no compare-and-swap: a lease that verified before our label landed did
            # not see it and goes on to anchor, whatever a ranking of the two says. So whoever
            # sees the other backs off; both may, and the next tick admits one of them. (The
            # planner's ranking still settles leftovers, such as a killed admission's labels.)
            raise LeaseConflict(
                f"runner {runner.name} ({runner_id}) is also leased by {', '.join(others)}; "
                "this admission backs off"
            )
    anchor = by_id[admit.anchor_id]
    wanted = {fold(label) for label in admit.anchor_labels}
    foreign = [label for label in anchor.managed_job_labels() if label not in wanted]
    if foreign:
        raise LeaseConflict(
            f"anchor {anchor.name} ({anchor.id}) already carries job labels {', '.join(foreign)}"
        )
    twin = _anchored_twin(admit, fleet, wanted, ours)
    if twin is not None:
        runner, label = twin
        raise LeaseConflict(
            f"job {admit.job_id} is already anchored on runner {runner.name} ({runner.id}) "
            f"under {label}; this admission backs off"
        )
    present = frozenset(label for label in anchor.managed_job_labels() if label in wanted)
    return Verification(present)


def _anchored_twin(
    admit: Admit, fleet: Sequence[Runner], wanted: frozenset[str] | set[str], ours: str
) -> tuple[Runner, str] | None:
    """Another lease of the same job and attempt whose anchor already carries the job's labels:
    a second controller admitted the job first, so this lease would only hold runners until the
    next tick releases it. Seen only when the read was the whole fleet (the list pages); an
    unanchored twin is left to the planner, as both would back off from each other."""
    mine = set(admit.runner_ids)
    for runner in fleet:
        if runner.id in mine or not wanted <= runner.folded:
            continue
        for label in runner.lease_labels:
            if label == ours:
                continue
            try:
                other = LeaseLabel.parse(label)
            except LabelError:
                continue
            if other.job_id == admit.job_id and other.attempt == admit.attempt:
                return runner, label
    return None


RUNNERS_PER_PAGE = 100  # GitHub's largest page of the runner list


async def read_leased_runners(
    client: LeaseClient, runner_ids: Collection[int], fleet_size: int | None = None
) -> list[Runner]:
    """A fresh read (never a cached copy) of `runner_ids`: one GET each when that is fewer
    requests than the runner list's pages (`fleet_size` runners), else every page. A runner
    that is gone is simply missing, which `check_lease` reports."""
    pages = -(-fleet_size // RUNNERS_PER_PAGE) if fleet_size else 0
    if len(runner_ids) >= pages:
        return await client.list_runners(conditional=False)
    chosen: list[Runner] = []
    for runner_id in sorted(runner_ids):
        with contextlib.suppress(NotFoundError):
            chosen.append(await client.get_runner(runner_id))
    return chosen


async def verify_lease(
    client: LeaseClient, admit: Admit, *, fleet_size: int | None = None
) -> Verification:
    """Step 2: re-read the leased runners unconditionally and check the lease on them.

    When the fleet spans more list pages than the lease has runners, only the chosen runners
    are read (one fresh GET each): N reads instead of every page.
    """
    return check_lease(admit, await read_leased_runners(client, admit.runner_ids, fleet_size))


class FleetVerifier(Protocol):
    """Verification shared by the admissions of one batch (`admission/batch_verify.py`); who
    runs the batch calls `leave` for each admission that ended, so none is waited for."""

    async def verify(self, client: LeaseClient, admit: Admit) -> Verification: ...

    def leave(self, admit: Admit) -> None: ...


# A lease without an anchor is another controller's to release once it is older than the
# orphan grace (30 s by default), so the anchor must land well inside it: an anchor written
# after that release would dispatch the job onto a runner whose lease is gone.
ANCHOR_WITHIN_S = 20.0
_DEADLINE_POLL_S = 0.05


def anchor_window_s(orphan_grace_s: float) -> float:
    """How long after its stamp a lease's anchor may still be written: `ANCHOR_WITHIN_S`, or
    two thirds of a longer orphan grace (the rest is margin for clocks and a slow write).
    Every controller of a fleet must share the grace, as they share the policy."""
    return max(ANCHOR_WITHIN_S, orphan_grace_s * 2 / 3)


@dataclass(frozen=True, slots=True)
class AnchorDeadline:
    """When the anchor may still be written: `within_s` after the lease label's stamp, by
    `clock` (the clock the planner stamps with). Keep `within_s` below the orphan grace."""

    within_s: float = ANCHOR_WITHIN_S
    clock: Callable[[], float] = time.time

    def remaining(self, admit: Admit) -> float:
        return _created(admit.lease_label) + self.within_s - self.clock()


async def add_anchor_labels(
    client: LeaseClient,
    admit: Admit,
    stack: CompensationStack,
    verified: Verification,
    *,
    deadline: AnchorDeadline | None = None,
) -> None:
    """Step 3: give the anchor every per-job label in ONE request; this is what dispatches.

    With a `deadline`, a lease too old to anchor safely is given up (LeaseLost) instead, and
    a write still retrying when the deadline passes is abandoned the same way.
    """
    _check_anchor_labels(admit)
    if deadline is not None and deadline.remaining(admit) <= 0:
        raise LeaseLost(_too_late(admit, deadline))
    for label in admit.anchor_labels:
        if fold(label) not in verified.anchor_present:
            stack.push_label_removal(client, admit.anchor_id, label)
    try:
        await _write_anchor(client, admit, deadline)
    except Exception:
        # The write may have landed before it failed (a lost answer, a timeout, the deadline
        # cutting a retry short), and GitHub may have dispatched the job at once: unwinding
        # would then leave a running job without its lease. A busy anchor carrying every
        # label we sent is that case, and the lease stands.
        if not await _dispatched(client, admit):
            raise


async def _write_anchor(client: LeaseClient, admit: Admit, deadline: AnchorDeadline | None) -> None:
    write = client.add_labels(admit.anchor_id, list(admit.anchor_labels))
    if deadline is None:
        await write
        return
    task = asyncio.ensure_future(write)
    try:
        while not task.done():
            if deadline.remaining(admit) <= 0:
                raise LeaseLost(_too_late(admit, deadline))
            await asyncio.wait({task}, timeout=_DEADLINE_POLL_S)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    task.result()


async def _dispatched(client: LeaseClient, admit: Admit) -> bool:
    """True when the anchor is busy and carries the lease and every anchor label (one read)."""
    try:
        anchor = await client.get_runner(admit.anchor_id)
    except Exception:
        return False
    wanted = {fold(label) for label in (admit.lease_label, *admit.anchor_labels)}
    return anchor.busy and wanted <= anchor.folded


def _too_late(admit: Admit, deadline: AnchorDeadline) -> str:
    return (
        f"lease {admit.lease_label} is {deadline.within_s - deadline.remaining(admit):.0f}s "
        f"old, past the {deadline.within_s:.0f}s in which its anchor may be written; another "
        "controller may release it as an orphan"
    )


def _check_anchor_labels(admit: Admit) -> None:
    bad = [label for label in admit.anchor_labels if not is_anchor_label(label)]
    if bad or not admit.anchor_labels:
        raise ValueError(
            f"Admit.anchor_labels for job {admit.job_id} must be ci-job-*, ci-attempt-* and "
            f"nodes:* labels only; got {list(admit.anchor_labels)}"
        )


# ---- the whole admission, and removal ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdmitOutcome:
    """How one admission ended: admitted, or rolled back with the reason and what was undone."""

    job_id: int
    lease_label: str
    admitted: bool
    reason: str
    undone: tuple[tuple[int, str], ...] = ()
    left_behind: tuple[tuple[int, str, str], ...] = ()


LabelStep = Callable[[Admit, CompensationStack], Awaitable[None]]
VerifyStep = Callable[[Admit], Awaitable[Verification]]
AnchorStep = Callable[[Admit, CompensationStack, Verification], Awaitable[None]]
RollbackHook = Callable[[BaseException, UnwindReport], None]


class Admission:
    """One admission that may take several runs of the unit carrying it (a retried Prefect
    task): the steps done, the verification and the compensation stack outlive a run.

    A run that fails transiently while more runs remain (`retries`) raises with the stack kept:
    the next run resumes at the step that failed, re-sends only the writes not yet confirmed
    and rolls nothing back. Any other failure, or one on the last run, unwinds the stack.
    """

    def __init__(self, admit: Admit, *, retries: int = 0) -> None:
        self.admit = admit
        self.retries = retries
        self.stack = CompensationStack()
        self.runs = 0
        self._labelled = False
        self._verified: Verification | None = None
        self._settled = False

    async def run(
        self,
        label: LabelStep,
        verify: VerifyStep,
        anchor: AnchorStep,
        *,
        on_rollback: RollbackHook | None = None,
    ) -> AdmitOutcome:
        """Run the steps not yet done, in order. A LeaseError (conflict, lost runner) becomes
        a rolled-back outcome; any other exception, BaseException included (a cancelled or
        terminated run), is re-raised after compensation ran, or, when transient with runs
        left, re-raised as it is, for the next run to resume."""
        if self._settled:
            raise RuntimeError(f"admission of lease {self.admit.lease_label} already settled")
        self.runs += 1
        admit = self.admit
        try:
            if not self._labelled:
                await label(admit, self.stack)
                self._labelled = True
            if self._verified is None:
                self._verified = await verify(admit)
            await anchor(admit, self.stack, self._verified)
        except AlreadyRunning as exc:
            self._settle(commit=True)
            return AdmitOutcome(admit.job_id, admit.lease_label, False, f"AlreadyRunning: {exc}")
        except BaseException as exc:
            if is_transient(exc) and self.runs <= self.retries:
                raise  # resumed by the next run: nothing is rolled back
            report = await self.abandon()
            if on_rollback is not None:
                on_rollback(exc, report)
            if isinstance(exc, LeaseError):
                return AdmitOutcome(
                    admit.job_id,
                    admit.lease_label,
                    False,
                    f"{type(exc).__name__}: {exc}",
                    tuple(report.undone),
                    tuple(report.failed),
                )
            raise
        self._settle(commit=True)
        return AdmitOutcome(admit.job_id, admit.lease_label, True, "admitted")

    async def abandon(self) -> UnwindReport:
        """Unwind what the runs wrote (shielded: a cancelled tick still removes it); for the
        carrier's caller when no further run will come. Nothing after the admission settled."""
        if self._settled:
            return UnwindReport()
        self._settle(commit=False)
        return await asyncio.shield(self.stack.unwind())

    @property
    def settled(self) -> bool:
        return self._settled

    def _settle(self, *, commit: bool) -> None:
        self._settled = True
        if commit:
            self.stack.commit()


async def run_admission(
    admit: Admit,
    label: LabelStep,
    verify: VerifyStep,
    anchor: AnchorStep,
    *,
    on_rollback: RollbackHook | None = None,
) -> AdmitOutcome:
    """Run label, verify, anchor in order; on any failure unwind the stack (one run of an
    `Admission` without retries).

    The steps are injected so that each caller chooses how they reach GitHub while the order
    and the compensation stay here, in one place. A LeaseError (conflict, lost runner) becomes
    a rolled-back outcome; any other exception, BaseException included (a cancelled or
    terminated run), is re-raised after compensation ran.
    """
    return await Admission(admit).run(label, verify, anchor, on_rollback=on_rollback)


@dataclass(frozen=True, slots=True)
class LeaseSteps:
    """The three protocol steps straight over one client, for `Admission.run`; with a
    `verifier`, the fresh read that verifies is shared with the rest of its batch."""

    client: LeaseClient
    fleet_size: int | None = None
    deadline: AnchorDeadline | None = AnchorDeadline()
    verifier: FleetVerifier | None = None

    async def label(self, admit: Admit, stack: CompensationStack) -> None:
        await add_lease_labels(self.client, admit, stack)

    async def verify(self, admit: Admit) -> Verification:
        if self.verifier is not None:
            return await self.verifier.verify(self.client, admit)
        return await verify_lease(self.client, admit, fleet_size=self.fleet_size)

    async def anchor(self, admit: Admit, stack: CompensationStack, verified: Verification) -> None:
        await add_anchor_labels(self.client, admit, stack, verified, deadline=self.deadline)

    async def run(
        self, admission: Admission, *, on_rollback: RollbackHook | None = None
    ) -> AdmitOutcome:
        return await admission.run(self.label, self.verify, self.anchor, on_rollback=on_rollback)


async def admit_lease(
    client: LeaseClient,
    admit: Admit,
    *,
    fleet_size: int | None = None,
    on_rollback: RollbackHook | None = None,
    deadline: AnchorDeadline | None = AnchorDeadline(),
    verifier: FleetVerifier | None = None,
) -> AdmitOutcome:
    """The whole protocol straight over a client (no Prefect): N + 1 label writes, one read
    (or a share of a batch's read, with `verifier`).

    `deadline` bounds when the anchor may be written (None: never give up on time).
    """
    steps = LeaseSteps(client, fleet_size, deadline, verifier)
    return await steps.run(Admission(admit), on_rollback=on_rollback)


@dataclass(frozen=True, slots=True)
class RemovalOutcome:
    """Labels removed, and labels that were already gone (GitHub answered 404)."""

    removed: tuple[tuple[int, str], ...]
    already_gone: tuple[tuple[int, str], ...]


def _removal_pairs(pairs: Sequence[tuple[int, Sequence[str]]]) -> list[tuple[int, str]]:
    flat: list[tuple[int, str]] = []
    for runner_id, labels in pairs:
        for label in labels:
            if not is_managed(label):
                raise UnmanagedLabelError(
                    f"refusing to remove {label!r} from runner {runner_id}: only ci-lease-*, "
                    "ci-job-*, ci-attempt-* and nodes:* labels are ever removed"
                )
            flat.append((runner_id, label))
    return flat


async def remove_labels(
    client: LeaseClient, pairs: Sequence[tuple[int, Sequence[str]]]
) -> RemovalOutcome:
    """DELETE each managed label from its runner; a 404 means it is already gone (idempotent)."""
    removed: list[tuple[int, str]] = []
    gone: list[tuple[int, str]] = []
    for runner_id, label in _removal_pairs(pairs):
        if await client.remove_label(runner_id, label):
            removed.append((runner_id, label))
        else:
            gone.append((runner_id, label))
    return RemovalOutcome(tuple(removed), tuple(gone))


RemoveLabels = Callable[[Sequence[tuple[int, Sequence[str]]]], Awaitable[RemovalOutcome]]


@dataclass(frozen=True, slots=True)
class DispatchCheck:
    """A fresh read of a lease's job and anchor, taken right before its labels go.

    `job` is None when GitHub no longer has the job (404); `anchor_busy` is False when the lease
    has no anchor, or the anchor is gone.
    """

    job: Job | None
    anchor_busy: bool

    def started_on(self, release: Release) -> bool:
        """True when the job may be running on one of the lease's runners: its tokens are in
        use and the lease label must stay. A busy anchor counts (GitHub may show the runner
        busy before the job's status changes); a job that ended, or runs elsewhere, does not."""
        if self.anchor_busy:
            return True
        job = self.job
        if job is None or job.status in NOT_STARTED or job.status == JobStatus.COMPLETED:
            return False
        if job.status == JobStatus.IN_PROGRESS and job.runner_id is not None:
            return job.runner_id in release.runner_ids
        return True  # running on a runner it does not name, or a status we cannot judge


ReadDispatch = Callable[[int, int | None], Awaitable[DispatchCheck]]
"""A job id and its lease's anchor id (or None) -> a fresh DispatchCheck."""


class DispatchClient(Protocol):
    """The reads `read_dispatch` needs (both `GitHubClient` methods)."""

    async def get_job(self, job_id: int) -> Job | None: ...

    async def get_runner(self, runner_id: int) -> Runner: ...


async def read_dispatch(
    client: DispatchClient, job_id: int, anchor_id: int | None
) -> DispatchCheck:
    """Read the anchor, then the job, fresh: a dispatch between the two reads shows in the job.

    A job GitHub answers malformed raises (MalformedResponse): the release is then not made."""
    anchor_busy = False
    if anchor_id is not None:
        try:
            anchor_busy = (await client.get_runner(anchor_id)).busy
        except NotFoundError:
            anchor_busy = False
    return DispatchCheck(await client.get_job(job_id), anchor_busy)


@dataclass(frozen=True, slots=True)
class ReleaseOutcome:
    """How one release ended: its labels removed, or the lease kept because its job started."""

    lease_label: str
    released: bool
    reason: str


async def release_lease(
    release: Release, remove: RemoveLabels, read: ReadDispatch | None = None
) -> ReleaseOutcome:
    """Carry out one release without stripping a job that GitHub dispatches meanwhile.

    A lease whose job may still be dispatched (`Release.may_dispatch`) is decided from a read
    that may be seconds old. So, with `read`: re-read the job and the anchor, and keep the lease
    if the job started on it; remove the anchor's `ci-job-*` first, after which GitHub can no
    longer dispatch the job there; read again, and if the job started in between, keep the
    lease label (its runners stay counted while the job runs; the job needs its dispatch labels
    no more, so they are not restored, and the lease is released when the job ends); only then
    remove the rest. Without `read`, or for a job known to have started or ended, every label
    goes in one step, as before.
    """
    if not release.may_dispatch or read is None:
        await remove(release.labels)
        return ReleaseOutcome(release.lease_label, True, "released")
    if (await read(release.job_id, release.anchor_id)).started_on(release):
        return ReleaseOutcome(
            release.lease_label, False, f"job {release.job_id} started before its release"
        )
    if release.dispatch_gate:
        await remove(release.dispatch_gate)
        if (await read(release.job_id, release.anchor_id)).started_on(release):
            return ReleaseOutcome(
                release.lease_label,
                False,
                f"job {release.job_id} started while its dispatch labels were removed; the lease "
                "label stays until it ends",
            )
    await remove(release.after_gate())
    return ReleaseOutcome(release.lease_label, True, "released")


def lease_labels_for_job(
    fleet: Sequence[Runner], job_id: int, attempt: int | None = None
) -> list[tuple[int, tuple[str, ...]]]:
    """Every managed label of a job's leases: lease labels plus the anchor's job labels.

    Used to release a job's lease at once when its CI job ends, without waiting for the planner.
    """
    labels: set[str] = set()
    for runner in fleet:
        for label in runner.lease_labels:
            try:
                parsed = LeaseLabel.parse(label)
            except LabelError:
                continue
            if parsed.job_id == job_id and (attempt is None or parsed.attempt == attempt):
                labels.add(label)
    pairs: list[tuple[int, tuple[str, ...]]] = []
    for runner in sorted(fleet, key=lambda r: r.id):
        mine = [label for label in runner.lease_labels if label in labels]
        if not mine:
            continue
        # Job labels belong to the runner's lease only when it holds no other lease.
        sole = len(mine) == len(runner.lease_labels)
        job_labels = runner.managed_job_labels() if sole else []
        pairs.append((runner.id, tuple(job_labels + mine)))  # stop dispatch first
    return pairs
