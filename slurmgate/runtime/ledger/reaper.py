"""The reaper: cancel what allocation runs whose controller died left in Slurm, and say so."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from slurmgate.errors import one_line
from slurmgate.runtime.ledger import heartbeat
from slurmgate.runtime.ledger.comment import ProcessIdentity, parse_job_comment
from slurmgate.runtime.ledger.records import RunRecord, RunStatus
from slurmgate.runtime.procs import cmdline_contains, hidden_but_alive, process_start_ticks
from slurmgate.settings.runtime import LedgerSettings
from slurmgate.slurm import commands as slurm

REAP_BACKOFF_S = 30.0
REAP_BACKOFF_MAX_S = 300.0


def stale_records(records: Iterable[RunRecord]) -> list[RunRecord]:
    """Unfinished runs of this host whose controller is dead: what a reaper must clean.

    Reads /proc only, never Slurm, so a pass with nothing stale costs no Slurm command. Runs of
    other hosts (a shared home directory) are left to a reaper on their own host.
    """
    return [
        rec
        for rec in records
        if not rec.status.finished and rec.on_this_host() and not rec.controller_alive()
    ]


def _ignore(message: str) -> None:
    return None


def reap_due(rec: RunRecord, now: float) -> bool:
    """False while a stale run waits out the backoff of its last failed reap (defer_reap)."""
    return (rec.reap_retry_at or 0.0) <= now


class JobListing:
    """Every user's pending and running jobs by id, read from Slurm at most once a pass
    (`squeue --all --json`) and only when first asked: the record reap and the all-users reap
    of one pass share it."""

    def __init__(self, *, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self._jobs: dict[str, slurm.QueuedJob] | None = None

    def _read(self) -> dict[str, slurm.QueuedJob]:
        """Raises SlurmError when Slurm cannot answer, or answers what cannot be read."""
        if self._jobs is None:
            listed = slurm.jobs_of_all_users(timeout=self.timeout)
            self._jobs = {job.job_id: job for job in listed}
        return self._jobs

    def jobs(self) -> list[slurm.QueuedJob]:
        return list(self._read().values())

    def job(self, job_id: str) -> slurm.QueuedJob | None:
        """The job while it is pending or running, else None (over, or never known)."""
        return self._read().get(job_id)


def reap_run(
    rec: RunRecord,
    *,
    timeout: float = 10.0,
    listing: JobListing | None = None,
    note: Callable[[str], Any] = _ignore,
) -> list[str]:
    """Cancel what one dead controller's run left: its owned job, else its steps; srun groups.

    The job a record names is cancelled, or its steps listed, only while Slurm runs it as the
    user who owns the record file: a record's job id may since name another user's job (Slurm
    reuses ids past MaxJobId), and a reaper that is root or a Slurm operator could cancel it.
    Such a job is left alone, with one `note` saying why. A run whose salloc was granted no job
    id is cancelled by name, among the record owner's jobs only.

    Raises SlurmError when Slurm cannot answer: the run stays unreaped for a later pass.
    """
    run_id, job = rec.run_id, rec.job_id
    owner = rec.owner_uid
    actions: list[str] = []
    if listing is None:
        listing = JobListing(timeout=timeout)
    queued = listing.job(job) if job else None
    if job and queued is None:
        pass  # the allocation is already over: Slurm has ended its steps
    elif queued is not None and queued.user_id != owner:
        note(
            f"left job {job} alone: Slurm runs it as user {queued.user} (uid {queued.user_id}), "
            f"not as the record's owner (uid {owner})"
        )
    elif not job:
        if rec.owned_allocation:
            # killed while salloc waited: the request may still be pending, or granted since
            slurm.scancel_by_name(run_id, user=owner, timeout=timeout)
            actions.append(f"scancel --name={run_id} (salloc had granted no job id)")
    elif rec.owned_allocation:
        if slurm.scancel(job, timeout=timeout):
            actions.append(f"scancel {job} (owned allocation)")
    else:
        for step in slurm.list_steps(job, timeout=timeout):
            if step.name.startswith(run_id) and slurm.scancel(step.step_id, timeout=timeout):
                actions.append(f"scancel {step.step_id} ({step.name})")
    for step_record in rec.steps:
        pgid = step_record.pgid
        if pgid is not None and _is_runs_srun(pgid, run_id, step_record.step_name):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
                actions.append(f"SIGKILL group {pgid} ({step_record.name})")
    return actions


def _is_runs_srun(pgid: int, run_id: str, step_name: str | None) -> bool:
    """The group leader `pgid` is a live process of this user that the run started: its
    command line names the run's step (an srun carries `--job-name=<run id>-<role>`)."""
    if pgid <= 1 or pgid == os.getpgid(0):
        return False
    try:
        owner = os.stat(f"/proc/{pgid}").st_uid
    except OSError:
        return False
    if owner != os.geteuid():
        return False
    return cmdline_contains(pgid, step_name or run_id)


def _update_record(rec: RunRecord, **changes: Any) -> None:
    """Apply `changes` to `rec` and to the file it was read from, re-read first, so fields
    the controller wrote since are kept."""
    for key, value in changes.items():
        setattr(rec, key, value)
    if rec.path is None:
        return
    stored = RunRecord.read(rec.path)
    for key, value in changes.items():
        setattr(stored, key, value)
    stored.write()


def mark_reaped(rec: RunRecord, actions: list[str]) -> None:
    """Write `status: reaped` (with what was done, and by whom) into the run's record file."""
    _update_record(
        rec,
        status=RunStatus.REAPED,
        status_before_reap=rec.status,
        reaped_at=round(time.time(), 3),
        reaped_by=ProcessIdentity.current(),
        reap_actions=list(actions),
    )


def defer_reap(rec: RunRecord, reason: str, *, now: float | None = None) -> float:
    """Record a failed reap; the next try waits 30 s, doubling up to 5 min. Returns the wait.

    A Slurm that cannot answer costs a command timeout; without a wait, every 30 s tick would.
    """
    failures = (rec.reap_failures or 0) + 1
    wait = min(REAP_BACKOFF_S * 2.0 ** min(failures - 1, 16), REAP_BACKOFF_MAX_S)
    _update_record(
        rec,
        reap_failures=failures,
        reap_retry_at=round((time.time() if now is None else now) + wait, 3),
        reap_error=reason,
    )
    return wait


def _defer_quietly(rec: RunRecord, reason: str) -> float:
    try:
        return defer_reap(rec, reason)
    except Exception:  # an unwritable record is retried on the next pass instead
        return 0.0


@dataclass
class ReapTally:
    """One reap pass: runs reaped, what was done to each, and stale runs left for a later pass
    (Slurm did not answer now or at the last try, whose backoff has not run out).
    `slurm_error` says why Slurm stopped the pass, when it did."""

    reaped: int = 0
    deferred: int = 0
    actions: list[str] = field(default_factory=list)
    slurm_error: str | None = None


def reap_stale_runs(
    records: Iterable[RunRecord],
    *,
    timeout: float = 10.0,
    wait_out_backoff: bool = True,
    info: Callable[[str], Any] = _ignore,
    warn: Callable[[str], Any] = _ignore,
    all_users: bool = False,
    stale_after_s: float | None = None,
) -> ReapTally:
    """Reap every stale run that is due, one `info` line per action; the one reap pass.
    With `all_users`, then the allocations of other users' and other hosts' dead runs
    (`reap_foreign_allocations`, one `squeue` a pass; `stale_after_s` for their heartbeats).

    A pass with nothing stale runs no Slurm command. When Slurm cannot answer, one `warn` line
    gives the reason and every due run waits (30 s, doubling to 5 min) for a later pass; the
    scheduled pass honours that wait, a pass by hand (`wait_out_backoff=False`) does not.
    """
    records = list(records)
    stale = stale_records(records)
    now = time.time()
    due = [rec for rec in stale if not wait_out_backoff or reap_due(rec, now)]
    tally = ReapTally()
    listing = JobListing(timeout=timeout)
    for index, rec in enumerate(due):
        run_id, job_id = rec.run_id, rec.job_id or "-"
        notes: list[str] = []
        try:
            actions = reap_run(rec, timeout=timeout, listing=listing, note=notes.append)
        except slurm.SlurmError as exc:
            # Slurm is down or absent: one line for the pass, and every due run waits
            left = due[index:]
            tally.slurm_error = one_line(exc)
            waits = [_defer_quietly(r, tally.slurm_error) for r in left]
            warn(
                f"reap deferred run={run_id} job={job_id}: {len(left)} stale run(s) wait "
                f"{min(waits):.0f} s for Slurm: {tally.slurm_error}"
            )
            break
        except Exception as exc:
            reason = one_line(exc)
            wait = _defer_quietly(rec, reason)
            warn(f"reap failed run={run_id} job={job_id} (retry in {wait:.0f} s): {reason}")
            continue
        for action in actions + notes or ["nothing left (allocation over, no live srun group)"]:
            info(f"reap run={run_id} job={job_id} {action}")
        try:
            mark_reaped(rec, actions + notes)
        except Exception as exc:
            warn(f"reap run={run_id} job={job_id} done, but its record could not be marked: "
                 f"{one_line(exc)}")  # fmt: skip
        tally.reaped += 1
        tally.actions += actions
    tally.deferred = len(stale) - tally.reaped
    if all_users:
        others = reap_foreign_allocations(
            {rec.run_id for rec in records},
            timeout=timeout,
            info=info,
            warn=warn,
            stale_after_s=stale_after_s,
            listing=listing,
        )
        tally.reaped += others.reaped
        tally.deferred += others.deferred
        tally.actions += others.actions
        tally.slurm_error = tally.slurm_error or others.slurm_error
    return tally


def reap_all_users_from_env(env: dict[str, str] | None = None) -> bool:
    """`SLURMGATE_REAP_ALL_USERS=1`: the scheduled pass also reaps other users' runs."""
    value = (LedgerSettings.environ() if env is None else env).get("SLURMGATE_REAP_ALL_USERS", "")
    return value.strip().lower() in {"1", "true", "yes", "on"}


# -- runs of other users ------------------------------------------------------------------


@dataclass(frozen=True)
class ForeignAllocation:
    """An allocation another user's run made (its job comment names run and controller)."""

    job_id: str
    run_id: str
    user: str
    controller: ProcessIdentity
    why: str  # what says its controller is gone


def _controller_gone(controller: ProcessIdentity) -> bool:
    """The controller process no longer exists. Where /proc hides other users' processes
    (`hidepid`), a pid the kernel still knows counts as alive: its start time cannot be read,
    and cancelling a live run is worse than reaping a dead one a heartbeat later."""
    started = process_start_ticks(controller.pid)
    if started is None and hidden_but_alive(controller.pid):
        return False
    if controller.started is None:
        return started is None
    return started != controller.started


def foreign_stale_allocations(
    jobs: Iterable[slurm.QueuedJob],
    known_run_ids: set[str],
    *,
    host: str,
    now: float,
    stale_after_s: float = heartbeat.DEFAULT_STALE_AFTER_S,
    gone: Callable[[ProcessIdentity], bool] = _controller_gone,
) -> list[ForeignAllocation]:
    """Allocations of runs this pass has no record of whose controller is gone: on `host`, its
    process has exited; on another host of the site, its last heartbeat (the comment's `beat=`)
    is older than `stale_after_s`. A comment without a beat from another host is left alone
    (nothing says whether its controller lives). A job counts only when its name is the run id
    its comment gives (as `salloc` names it), so a comment can steer the reaper to nothing but
    the job that carries it. That job's user wrote the comment (or a Slurm administrator did):
    there is no record here whose owner to check it against, and none is needed."""
    found = []
    for job in jobs:
        parsed = parse_job_comment(job.comment)
        if parsed is None:
            continue
        run_id, controller, beat = parsed
        if run_id != job.name or run_id in known_run_ids:
            continue
        who = f"controller pid {controller.pid} on {controller.host}"
        if controller.host == host:
            why = f"{who} is gone" if gone(controller) else None
        elif beat is not None and now - beat > stale_after_s:
            why = f"{who} last beat {now - beat:.0f} s ago (over {stale_after_s:.0f} s)"
        else:
            why = None  # another host's controller without a beat, or one still beating
        if why is not None:
            found.append(ForeignAllocation(job.job_id, run_id, job.user, controller, why))
    return found


def reap_foreign_allocations(
    known_run_ids: set[str],
    *,
    timeout: float = 10.0,
    info: Callable[[str], Any] = _ignore,
    warn: Callable[[str], Any] = _ignore,
    stale_after_s: float | None = None,
    listing: JobListing | None = None,
) -> ReapTally:
    """Cancel the allocations of any user's runs whose controller died, found through `squeue`
    (a run of the runner service's user, whose record this user cannot read): on this host by
    its process, on another host of the site by a heartbeat older than `stale_after_s`
    (default `SLURMGATE_REAP_STALE_S`, 600 s).

    Runs in an allocation they did not make carry no comment: their own user's reaper cleans
    them from the record. Cancelling another user's job needs root or a Slurm operator; a
    refusal is one warning naming the fix, and the job is asked again on the next pass.
    """
    import socket

    tally = ReapTally()
    if stale_after_s is None:
        try:
            stale_after_s = heartbeat.stale_after_from_env()
        except ValueError as exc:
            stale_after_s = heartbeat.DEFAULT_STALE_AFTER_S
            warn(f"{exc}; other hosts' runs are reaped after {stale_after_s:.0f} s")
    try:
        jobs = (listing or JobListing(timeout=timeout)).jobs()
    except slurm.SlurmError as exc:
        tally.slurm_error = one_line(exc)
        warn(f"reap of other users' runs deferred: {tally.slurm_error}")
        return tally
    stale = foreign_stale_allocations(
        jobs,
        known_run_ids,
        host=socket.gethostname(),
        now=time.time(),
        stale_after_s=stale_after_s,
    )
    for alloc in stale:
        try:
            cancelled = slurm.scancel(alloc.job_id, timeout=timeout)
        except slurm.SlurmError as exc:
            tally.deferred += 1
            warn(
                f"reap failed run={alloc.run_id} job={alloc.job_id} of user {alloc.user} "
                f"({alloc.why}): {one_line(exc)}; run the reaper as root or a Slurm operator "
                "(sacctmgr modify user NAME set adminlevel=operator)"
            )
            continue
        if cancelled:
            action = f"scancel {alloc.job_id} (allocation of user {alloc.user}; {alloc.why})"
            info(f"reap run={alloc.run_id} job={alloc.job_id} {action}")
            tally.reaped += 1
            tally.actions.append(action)
    return tally
