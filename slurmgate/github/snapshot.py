"""Build the planner's `Snapshot` from GitHub: the fleet, active jobs, and every lease's job."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from slurmgate.admission.model import Job, JobStatus, Runner, Snapshot, leases_from_fleet
from slurmgate.admission.settings import AdmissionSettings
from slurmgate.github.client import JobSource, MalformedResponse
from slurmgate.github.skipqueue import SkipQueueAuthorizer, SkipQueueClient


class SnapshotClient(SkipQueueClient, Protocol):
    """The reads `take_snapshot` needs (all of them `GitHubClient` methods)."""

    async def list_runners(self, conditional: bool = True) -> list[Runner]: ...

    async def read_active_jobs(self) -> tuple[list[Job], dict[int, JobSource]]: ...

    async def get_job(self, job_id: int) -> Job | None: ...

    @property
    def unreadable_runners(self) -> int: ...


async def take_snapshot(
    client: SnapshotClient,
    *,
    clock: Callable[[], datetime] | None = None,
    settings: AdmissionSettings | None = None,
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
    """
    runners = await client.list_runners(conditional=True)
    active, sources = await client.read_active_jobs()
    jobs = {job.id: job for job in active}
    skip_queue: frozenset[int] = frozenset()
    if settings is not None:
        queued = [job for job in active if job.status == JobStatus.QUEUED]
        skip_queue = await SkipQueueAuthorizer(client, settings).authorized(queued, sources)
    leases, _ = leases_from_fleet(runners)
    missing: set[int] = set()
    for job_id in sorted({lease.job_id for lease in leases} - set(jobs)):
        try:
            job = await client.get_job(job_id)
        except MalformedResponse:
            continue  # unknown is not gone: the client has warned about it
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
    )


def _utcnow() -> datetime:
    return datetime.now(UTC)
