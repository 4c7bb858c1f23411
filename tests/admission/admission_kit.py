"""Builders for admission tests: runners, jobs, snapshots, and applying decisions to a fleet."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from slurmgate.admission.labels import fold
from slurmgate.admission.model import Decisions, Job, JobStatus, Runner, Snapshot
from slurmgate.settings.admission import AdmissionSettings

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
ON = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True)


def pool(
    name: str,
    count: int,
    start: int = 1,
    *,
    offline: set[int] | frozenset[int] = frozenset(),
    busy: set[int] | frozenset[int] = frozenset(),
    extra: tuple[str, ...] = (),
) -> list[Runner]:
    """`count` runners of `cluster:<name>`, ids from `start`; offline/busy given as ids."""
    return [
        Runner(
            id=rid,
            name=f"{name}-{rid}",
            online=rid not in offline,
            busy=rid in busy,
            labels=("self-hosted", "Linux", f"cluster:{name}", *extra),
        )
        for rid in range(start, start + count)
    ]


def legacy(count: int, start: int, *, extra: tuple[str, ...] = ()) -> list[Runner]:
    return [
        Runner(rid, f"legacy-{rid}", True, False, ("self-hosted", "Linux", *extra))
        for rid in range(start, start + count)
    ]


def job(
    job_id: int,
    nodes: int | str | None = 1,
    *,
    pool_name: str | None = "x",
    score: str = "1.000",
    status: JobStatus = JobStatus.QUEUED,
    attempt: int = 1,
    age_s: int = 0,
    extra: tuple[str, ...] = (),
    managed: bool = True,
) -> Job:
    labels: list[str] = ["self-hosted"]
    if pool_name is not None:
        labels.append(f"cluster:{pool_name}")
    if managed:
        labels += [f"ci-job-{score}-t{job_id}", f"ci-attempt-{attempt}"]
        if nodes is not None:
            labels.append(f"nodes:{nodes}")
    labels += list(extra)
    return Job(
        id=job_id,
        run_id=job_id * 10,
        run_attempt=attempt,
        name=f"job-{job_id}",
        labels=tuple(labels),
        status=status,
        created_at=NOW - timedelta(seconds=age_s),
    )


def lease_runners(
    runners: list[Runner], the_job: Job, ids: list[int], *, created: datetime = NOW
) -> list[Runner]:
    """Give `ids` the job's lease label and the lowest of them its gate labels."""
    label = f"ci-lease-j{the_job.id}-a{the_job.run_attempt}-t{int(created.timestamp())}"
    anchor = min(ids)
    out = []
    for r in runners:
        if r.id in ids:
            extra = (label, *the_job.gate_labels()) if r.id == anchor else (label,)
            r = replace(r, labels=(*r.labels, *extra))
        out.append(r)
    return out


def snapshot(
    runners: list[Runner], jobs: list[Job], missing: frozenset[int] = frozenset()
) -> Snapshot:
    return Snapshot(tuple(runners), tuple(jobs), NOW, missing)


def apply(snap: Snapshot, decisions: Decisions) -> Snapshot:
    """What the lease protocol would leave behind if every decision were carried out."""
    labels = {r.id: list(r.labels) for r in snap.runners}
    for release in decisions.release:
        for rid, remove in release.labels:
            drop = {fold(x) for x in remove}
            labels[rid] = [x for x in labels[rid] if fold(x) not in drop]
    for clean in decisions.clean:
        drop = {fold(x) for x in clean.labels}
        labels[clean.runner_id] = [x for x in labels[clean.runner_id] if fold(x) not in drop]
    for admit in decisions.admit:
        for rid in admit.runner_ids:
            labels[rid].append(admit.lease_label)
        labels[admit.anchor_id].extend(admit.anchor_labels)
    runners = tuple(replace(r, labels=tuple(labels[r.id])) for r in snap.runners)
    return replace(snap, runners=runners)


def complete(snap: Snapshot, job_id: int) -> Snapshot:
    jobs = tuple(
        replace(j, status=JobStatus.COMPLETED, conclusion="success") if j.id == job_id else j
        for j in snap.jobs
    )
    return replace(snap, jobs=jobs)


def admitted(decisions: Decisions) -> dict[int, int]:
    """job id -> nodes admitted."""
    return {a.job_id: a.nodes for a in decisions.admit}


def blocked(decisions: Decisions) -> dict[int, str]:
    """job id -> block reason."""
    return {b.job_id: str(b.reason) for b in decisions.blocked}
