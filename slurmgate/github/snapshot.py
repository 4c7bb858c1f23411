"""Build the planner's `Snapshot` from GitHub: the fleet, active jobs, and every lease's job."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from slurmgate.admission.model import Job, JobStatus, Runner, Snapshot, leases_from_fleet
from slurmgate.github.client import JobSource
from slurmgate.github.errors import AuthError, GitHubError, MalformedResponse
from slurmgate.github.jobstore import JobEventStore, store_path
from slurmgate.github.scope import GitHubScope
from slurmgate.github.skipqueue import SkipQueueAuthorizer, SkipQueueClient, skip_queue_pr
from slurmgate.paths import state_dir
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.settings.github import EventReadSettings

log = logging.getLogger(__name__)


class SnapshotClient(SkipQueueClient, Protocol):
    """The reads `take_snapshot` needs (all of them `GitHubClient` methods)."""

    async def list_runners(self, conditional: bool = True) -> list[Runner]: ...

    async def read_active_jobs(self) -> tuple[list[Job], dict[int, JobSource]]: ...

    async def get_job(self, job_id: int, *, repo: str | None = None) -> Job | None: ...

    async def get_run_pull_requests(self, run_id: int, *, repo: str) -> frozenset[int]: ...

    @property
    def unreadable_runners(self) -> int: ...

    @property
    def unread_repos(self) -> dict[str, str]: ...

    @property
    def scope(self) -> GitHubScope: ...


@dataclass(frozen=True)
class EventReads:
    """Job events as the primary source: the store, and when to fall back to reading GitHub."""

    store: JobEventStore
    full_read_every: int = 10
    recheck_after_s: float = 120.0

    @classmethod
    def configured(cls, settings: EventReadSettings | None = None) -> EventReads | None:
        """The relay's store, when there is one (else None: the tick polls as it always has)."""
        chosen = settings or EventReadSettings()
        path = chosen.job_store or store_path(state_dir())
        store = JobEventStore.existing(Path(os.path.expanduser(path)))
        if store is None:
            return None
        return cls(store, chosen.full_read_every, chosen.event_recheck_s)


async def take_snapshot(
    client: SnapshotClient,
    *,
    clock: Callable[[], datetime] | None = None,
    settings: AdmissionSettings | None = None,
    events: EventReads | None = None,
) -> Snapshot:
    """One read of the fleet and the jobs, conditional (ETag) wherever GitHub allows it.

    Jobs are the queued and in-progress jobs of queued and in-progress runs, plus a fresh
    `get_job` for each job a lease points at that the listing did not show: a completed job is
    then told apart from a vanished one (404, recorded in `missing_job_ids`).

    What GitHub sends malformed is left out, never guessed at: a runner of the wrong shape is
    not in the fleet (it is counted, so the planner knows the fleet it sees is partial), a job
    listing of the wrong shape hides its jobs (they are not admitted),
    and a lease job whose own read is malformed is neither present nor missing, so the planner
    keeps its lease. Only a malformed runner listing fails the read (`MalformedResponse`):
    without the fleet there is nothing to plan, and nothing is written.

    With `settings`, queued skip-queue jobs are verified (`skipqueue.SkipQueueAuthorizer`,
    whose failed lookups only leave a job unverified); without, none is.

    With `events`, the jobs come from the relay's job-event store instead of a listing of every
    active run (`jobs_from_events`), and every `full_read_every`-th read polls as above and
    brings the store in line with what it listed. A lease job the store has is taken from it
    (a completed event releases its lease without a read); only one it lacks is read by id.
    """
    runners = await client.list_runners(conditional=True)
    stored: dict[int, Job] = {}
    polled = False
    if events is not None and not events.store.full_read_due(events.full_read_every):
        active, sources = await jobs_from_events(client, events, settings is not None)
    else:
        polled = True
        try:
            active, sources = await client.read_active_jobs()
        except BaseException:
            if events is not None:
                events.store.full_read_failed()  # the next read polls again
            raise
        if events is not None:
            listed = [(job, sources[job.id].repo) for job in active if job.id in sources]
            missed = events.store.replace_active(listed, client.scope.covers)
            if missed:
                log.info("full read: %d job(s) the events left active have ended", missed)
    jobs = {job.id: job for job in active}
    skip_queue: frozenset[int] = frozenset()
    if settings is not None:
        queued = [job for job in active if job.status == JobStatus.QUEUED]
        skip_queue = await SkipQueueAuthorizer(client, settings).authorized(queued, sources)
    leases, _ = leases_from_fleet(runners)
    missing: set[int] = set()
    unseen = {lease.job_id for lease in leases} - set(jobs)
    if events is not None and unseen:
        for job_id, item in events.store.latest(unseen).items():
            if item.job.status is JobStatus.COMPLETED:
                stored[job_id] = item.job
        jobs.update(stored)
    for job_id in sorted(unseen - set(stored)):
        try:
            job = await client.get_job(job_id)
        except MalformedResponse:
            continue  # unknown is not gone: the client has warned about it
        except AuthError as exc:
            if exc.status != 403:
                raise
            # A repository that may hold it refused (one of many, not granted): unknown, so
            # its lease is kept.
            log.warning("lease job %d: its state is unknown (%s); its lease is kept", job_id, exc)
            continue
        if job is None:
            missing.add(job_id)
        else:
            jobs[job.id] = job
    taken_at = (clock or _utcnow)()
    return Snapshot(
        runners=tuple(sorted(runners, key=lambda r: r.id)),
        jobs=tuple(sorted(jobs.values(), key=lambda j: j.id)),
        taken_at=taken_at,
        missing_job_ids=frozenset(missing),
        unreadable_runners=client.unreadable_runners,
        skip_queue_job_ids=skip_queue,
        unread_repos=tuple(sorted(client.unread_repos.items())) if polled else (),
        # the fairness rules' key: GitHub's repository names ignore case
        job_repos={job_id: source.repo.casefold() for job_id, source in sources.items()},
    )


def _utcnow() -> datetime:
    return datetime.now(UTC)


async def jobs_from_events(
    client: SnapshotClient, events: EventReads, verify_skip_queue: bool
) -> tuple[list[Job], dict[int, JobSource]]:
    """The scope's active jobs as the relay's events left them, repaired where they are stale.

    A queued job whose state nobody confirmed for `recheck_after_s` (no in_progress came) is
    read by id and the answer stored: a missed delivery costs one read, not a full poll. A
    queued skip-queue job gets its run's pull requests read (conditional), which the
    `workflow_job` delivery does not carry, so that authorization can check it.
    """
    now = events.store.clock()
    jobs: list[Job] = []
    sources: dict[int, JobSource] = {}
    for item in events.store.active(client.scope.covers):
        job = item.job
        if not job.active:
            continue  # waiting for an approval, say: its queued delivery comes later
        if job.status is JobStatus.QUEUED and now - item.seen_at > events.recheck_after_s:
            try:
                fresh = await client.get_job(job.id, repo=item.repo)
            except MalformedResponse:
                fresh = job  # unknown is not gone: keep what the event said
            if fresh is None:
                events.store.forget([job.id])
                continue
            events.store.record(fresh, item.repo, source="read")
            if not fresh.active:
                continue
            job = fresh
        pull_requests: frozenset[int] = frozenset()
        if verify_skip_queue and job.status is JobStatus.QUEUED and skip_queue_pr(job):
            try:
                pull_requests = await client.get_run_pull_requests(job.run_id, repo=item.repo)
            except GitHubError as exc:  # unverified for this read, asked again next read
                log.warning("run %s of job %s unreadable: %s", job.run_id, job.id, exc)
        jobs.append(job)
        sources[job.id] = JobSource(item.repo, pull_requests)
    return jobs, sources
