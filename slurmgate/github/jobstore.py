"""Job-event store: the latest workflow_job state per job, written by the relay, read by the tick.

The relay (`webhook.py`) and the reconcile tick are separate processes, so they share a small
SQLite file in the state directory (`state_dir()/job-events.sqlite`): one row per job, written
in one short transaction per delivery, read by the tick with one query. SQLite is in the
standard library, serialises the two writers (the relay, and the tick confirming what it read)
with its own file lock, and never leaves a half-written file behind, which a JSON file
rewritten by two processes would need locks and renames for. Reading Prefect's events through
its API instead would put Prefect in the core's read path (the core never imports it) and make
the tick page through every event of the window to rebuild the latest state per job.

A row only moves forward: queued, then in_progress, then completed (a delivery that arrives out
of order never takes a job back). `seen_at` is when the state was last confirmed, by a delivery
or by a read; the snapshot re-reads a queued job that has not been confirmed for a while.

Everything in it is treated as hostile, even though the relay only writes deliveries whose
HMAC it verified: a delivery larger than the bounds (labels, name) is not stored, the table
keeps at most `max_jobs` rows (completed ones go first, oldest first), finished jobs are
forgotten after `COMPLETED_KEEP_S`, and a row that does not read back as a job is skipped with
a warning. A file that is not a database is the same as no file: the tick polls.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from slurmgate.admission.model import NOT_STARTED, Job, JobStatus
from slurmgate.github.scope import is_repo

log = logging.getLogger(__name__)
_T = TypeVar("_T")

STORE_FILE = "job-events.sqlite"
MAX_JOBS = 20_000
"""Rows kept; a row is a few hundred bytes, at most about 3 kB with the bounds below."""
MAX_LABELS = 32
MAX_LABEL_CHARS = 100
MAX_NAME_CHARS = 512
COMPLETED_KEEP_S = 86_400.0
"""A finished job is remembered this long (a lease of it is released well before)."""
_MAX_ID = 2**63 - 1
_RANK = {JobStatus.IN_PROGRESS: 1, JobStatus.COMPLETED: 2}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER PRIMARY KEY,
    repo TEXT NOT NULL,
    run_id INTEGER NOT NULL,
    run_attempt INTEGER NOT NULL,
    name TEXT NOT NULL,
    labels TEXT NOT NULL,
    status TEXT NOT NULL,
    rank INTEGER NOT NULL,
    conclusion TEXT,
    runner_id INTEGER,
    runner_name TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    seen_at REAL NOT NULL,
    source TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_rank_seen ON jobs (rank, seen_at);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


def rank(status: JobStatus) -> int:
    """How far along a status is: not started 0, in progress 1, completed 2 (unknown -1)."""
    if status in NOT_STARTED:
        return 0
    return _RANK.get(status, -1)


def store_path(state_dir: Path) -> Path:
    return state_dir / STORE_FILE


def refusal(job: Job, repo: str) -> str | None:
    """Why a job cannot be stored (a bound it breaks), or None when it can."""
    if not is_repo(repo):
        return "repository is not OWNER/NAME"
    if not 0 < job.id <= _MAX_ID or not 0 <= job.run_id <= _MAX_ID:
        return "job or run id out of range"
    if rank(job.status) < 0:
        return f"status {job.status!r} is not one the store keeps"
    if len(job.labels) > MAX_LABELS:
        return f"{len(job.labels)} labels (at most {MAX_LABELS})"
    if any(len(label) > MAX_LABEL_CHARS for label in job.labels):
        return f"a label is longer than {MAX_LABEL_CHARS} characters"
    if len(job.name) > MAX_NAME_CHARS or len(job.runner_name or "") > MAX_NAME_CHARS:
        return f"job or runner name longer than {MAX_NAME_CHARS} characters"
    return None


@dataclass(frozen=True, slots=True)
class StoredJob:
    """One job as the store last saw it: the job, its repository, and when it was confirmed."""

    job: Job
    repo: str
    seen_at: float
    source: str


class JobEventStore:
    """The store file. Every call opens its own short connection: safe across processes."""

    def __init__(
        self,
        path: Path,
        *,
        max_jobs: int = MAX_JOBS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_jobs = max_jobs
        self.clock = clock
        self.unreadable = 0  # rows the last read skipped

    @classmethod
    def existing(cls, path: Path, **options: object) -> JobEventStore | None:
        """The store at `path` when the relay has made one there and it reads as a database;
        None otherwise (no relay: the tick polls, as it always has)."""
        if not path.is_file():
            return None
        store = cls(path, **options)  # type: ignore[arg-type]
        try:
            with closing(store._connect()) as db:
                db.execute("SELECT COUNT(*) FROM jobs").fetchone()
        except sqlite3.Error as exc:
            log.warning("job-event store %s is unreadable (%s); polling instead", path, exc)
            return None
        return store

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        # with WAL, NORMAL never corrupts the file; a power cut may lose the last deliveries,
        # which the full read repairs
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(_SCHEMA)
        if self.path.stat().st_mode & 0o077:
            self.path.chmod(0o600)
        return db

    # ---- writing ----

    def record(self, job: Job, repo: str, *, source: str = "event") -> bool:
        """Store one job's state (never backwards); False when a bound refuses it."""
        return self.record_many([(job, repo)], source=source) == 1

    def record_many(self, items: Iterable[tuple[Job, str]], *, source: str = "event") -> int:
        """Store many job states in one transaction; returns how many passed the bounds."""
        now = self.clock()
        rows = []
        for job, repo in items:
            why = refusal(job, repo)
            if why is not None:
                log.warning("job %s of %s not stored: %s", job.id, repo[:100], why)
                continue
            rows.append(_row(job, repo, now, source))
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(_UPSERT, rows)
            self._bound(db, now)
            db.execute("COMMIT")
        return len(rows)

    def forget(self, job_ids: Iterable[int]) -> None:
        ids = [(int(job_id),) for job_id in job_ids]
        with closing(self._connect()) as db:
            db.executemany("DELETE FROM jobs WHERE job_id = ?", ids)

    def _bound(self, db: sqlite3.Connection, now: float) -> None:
        db.execute("DELETE FROM jobs WHERE rank = 2 AND seen_at < ?", (now - COMPLETED_KEEP_S,))
        (count,) = db.execute("SELECT COUNT(*) FROM jobs").fetchone()
        if count > self.max_jobs:
            db.execute(
                "DELETE FROM jobs WHERE job_id IN "
                "(SELECT job_id FROM jobs ORDER BY rank = 2 DESC, seen_at ASC LIMIT ?)",
                (count - self.max_jobs,),
            )

    # ---- reading ----

    def active(self, covers: Callable[[str], bool] | None = None) -> list[StoredJob]:
        """The jobs last seen queued or in progress (of the repositories `covers` accepts)."""
        return self._select("rank < 2", (), covers)

    def latest(self, job_ids: Iterable[int]) -> dict[int, StoredJob]:
        """The stored state of each of `job_ids` that the store has."""
        wanted = sorted({int(job_id) for job_id in job_ids})[: self.max_jobs]
        found: dict[int, StoredJob] = {}
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for item in self._select(f"job_id IN ({marks})", tuple(chunk), None):
                found[item.job.id] = item
        return found

    def _select(
        self, where: str, args: tuple[object, ...], covers: Callable[[str], bool] | None
    ) -> list[StoredJob]:
        with closing(self._connect()) as db:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE {where} ORDER BY job_id LIMIT ?",
                (*args, self.max_jobs),
            ).fetchall()
        out: list[StoredJob] = []
        self.unreadable = 0
        for row in rows:
            item = _stored(row)
            if item is None:
                self.unreadable += 1
                continue
            if covers is None or covers(item.repo):
                out.append(item)
        if self.unreadable:
            log.warning("job-event store: %d unreadable rows skipped", self.unreadable)
        return out

    # ---- the full-read cadence ----

    def full_read_due(self, every: int) -> bool:
        """Count one snapshot read; True on the first and then on every `every`-th one."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT value FROM meta WHERE key = 'reads'").fetchone()
            reads = row[0] if row and isinstance(row[0], int) and row[0] >= 0 else 0
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('reads', ?)", (reads + 1,))
            db.execute("COMMIT")
        return reads % max(1, every) == 0

    def full_read_failed(self) -> None:
        """The full read this count asked for did not finish: make the next read one."""
        with closing(self._connect()) as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('reads', 0)")

    def replace_active(self, jobs: Iterable[tuple[Job, str]], covers: Callable[[str], bool]) -> int:
        """After a full read: store what it listed, and forget the jobs the store still held
        as active in the scope that the read did not list (their end was missed). Returns how
        many were forgotten."""
        listed = list(jobs)
        self.record_many(listed, source="read")
        shown = {job.id for job, _ in listed}
        missed = [item.job.id for item in self.active(covers) if item.job.id not in shown]
        self.forget(missed)
        return len(missed)


_COLUMNS = (
    "job_id, repo, run_id, run_attempt, name, labels, status, conclusion, runner_id, "
    "runner_name, created_at, started_at, completed_at, seen_at, source"
)
_UPSERT = f"""
INSERT INTO jobs ({_COLUMNS}, rank) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (job_id) DO UPDATE SET
    repo = excluded.repo, run_id = excluded.run_id, run_attempt = excluded.run_attempt,
    name = excluded.name, labels = excluded.labels, status = excluded.status,
    conclusion = excluded.conclusion, runner_id = excluded.runner_id,
    runner_name = excluded.runner_name, created_at = excluded.created_at,
    started_at = excluded.started_at, completed_at = excluded.completed_at,
    seen_at = excluded.seen_at, source = excluded.source, rank = excluded.rank
WHERE excluded.rank > jobs.rank OR (excluded.rank = jobs.rank AND excluded.seen_at >= jobs.seen_at)
"""


def _ts(at: datetime | None) -> float | None:
    return None if at is None else at.timestamp()


def _row(job: Job, repo: str, now: float, source: str) -> tuple[object, ...]:
    return (
        job.id,
        repo,
        job.run_id,
        job.run_attempt,
        job.name,
        json.dumps(list(job.labels)),
        job.status.value,
        job.conclusion,
        job.runner_id,
        job.runner_name,
        job.created_at.timestamp(),
        _ts(job.started_at),
        _ts(job.completed_at),
        now,
        source,
        rank(job.status),
    )


def _when(value: object) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise ValueError("timestamp out of range")
    return datetime.fromtimestamp(value, UTC)


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("not an integer")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("not text")
    return value


def _opt(value: object, kind: Callable[[object], _T]) -> _T | None:
    return None if value is None else kind(value)


def _stored(row: tuple[object, ...]) -> StoredJob | None:
    """A row read back as a job, or None when any field is not what the store writes."""
    try:
        (job_id, repo, run_id, attempt, name, labels_json, status, conclusion) = row[:8]
        (runner_id, runner_name, created, started, completed, seen_at, source) = row[8:]
        raw_labels = _str(labels_json)
        if len(raw_labels) > MAX_LABELS * (MAX_LABEL_CHARS + 8):
            raise ValueError("labels too long")
        labels = json.loads(raw_labels)
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise ValueError("labels")
        created_at = _when(created)
        if created_at is None or not isinstance(seen_at, (int, float)):
            raise ValueError("times")
        job = Job(
            id=_int(job_id),
            run_id=_int(run_id),
            run_attempt=_int(attempt),
            name=_str(name),
            labels=tuple(labels),
            status=JobStatus(_str(status)),
            created_at=created_at,
            conclusion=_opt(conclusion, _str),
            runner_id=_opt(runner_id, _int),
            runner_name=_opt(runner_name, _str),
            started_at=_when(started),
            completed_at=_when(completed),
        )
        where = _str(repo)
        if refusal(job, where) is not None:
            raise ValueError("bounds")
        return StoredJob(job, where, float(seen_at), _str(source))
    except (ValueError, TypeError, OverflowError, RecursionError):
        return None
