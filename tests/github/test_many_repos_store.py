"""The job-event store on its own: it only moves forward, it stays bounded, and what it reads
back from a tampered file is checked row by row."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from slurmgate.admission.model import Job, JobStatus
from slurmgate.github.jobstore import COMPLETED_KEEP_S, MAX_LABELS, JobEventStore

CREATED = datetime(2026, 1, 1, tzinfo=UTC)


def job(job_id: int, status: JobStatus = JobStatus.QUEUED, **extra: object) -> Job:
    base = Job(
        id=job_id,
        run_id=7,
        run_attempt=1,
        name=f"job-{job_id}",
        labels=("self-hosted", "cluster:a", "nodes:1"),
        status=status,
        created_at=CREATED,
    )
    return replace(base, **extra)  # type: ignore[arg-type]


def test_states_only_move_forward(tmp_path: Path) -> None:
    store = JobEventStore(tmp_path / "s.sqlite")
    assert store.record(job(1, JobStatus.COMPLETED, conclusion="success"), "acme/a")
    store.record(job(1, JobStatus.IN_PROGRESS), "acme/a")  # arrives late
    store.record(job(1, JobStatus.QUEUED), "acme/a")  # later still
    assert store.latest([1])[1].job.status is JobStatus.COMPLETED
    assert store.active() == []


def test_oversized_jobs_are_refused_and_the_table_is_bounded(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = JobEventStore(tmp_path / "s.sqlite", max_jobs=50, clock=lambda: now[0])
    many = tuple(f"l{i}" for i in range(MAX_LABELS + 1))
    assert not store.record(job(1, labels=many), "acme/a")
    assert not store.record(job(2, labels=("x" * 101,)), "acme/a")
    assert not store.record(job(3, name="n" * 513), "acme/a")
    assert not store.record(job(4), "not a repo")
    assert store.latest([1, 2, 3, 4]) == {}
    store.record_many([(job(i, JobStatus.COMPLETED), "acme/a") for i in range(10, 40)])
    now[0] += 1
    store.record_many([(job(i), "acme/a") for i in range(100, 140)])
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 50
    assert len(store.active()) == 40  # the finished ones went first
    now[0] += COMPLETED_KEEP_S + 2
    store.record(job(999), "acme/a")
    assert store.latest(range(10, 40)) == {}  # finished jobs age out


def test_tampered_rows_are_skipped_not_believed(tmp_path: Path) -> None:
    store = JobEventStore(tmp_path / "s.sqlite")
    store.record_many([(job(i), "acme/a") for i in (1, 2, 3, 4, 5, 6)])
    with sqlite3.connect(store.path) as db:
        db.execute('UPDATE jobs SET labels = \'{"not": "a list"}\' WHERE job_id = 1')
        db.execute("UPDATE jobs SET status = 'exploded' WHERE job_id = 2")
        db.execute("UPDATE jobs SET repo = '../../etc' WHERE job_id = 3")
        db.execute("UPDATE jobs SET created_at = 1e300 WHERE job_id = 4")
        db.execute("UPDATE jobs SET labels = ? WHERE job_id = 5", ("[" * 100_000,))
    assert [item.job.id for item in store.active()] == [6]
    assert store.unreadable == 5


def test_a_store_file_another_writer_left_reads_only_in_scope(tmp_path: Path) -> None:
    store = JobEventStore(tmp_path / "s.sqlite")
    store.record_many([(job(1), "acme/a"), (job(2), "other/b")])
    assert [i.job.id for i in store.active(lambda repo: repo.startswith("acme/"))] == [1]
    assert (store.path.stat().st_mode & 0o777) == 0o600


def test_full_read_cadence_counts_reads(tmp_path: Path) -> None:
    store = JobEventStore(tmp_path / "s.sqlite")
    assert [store.full_read_due(3) for _ in range(7)] == [
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]
