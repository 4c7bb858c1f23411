"""Runtime estimates for reservations: a job's timeout, or a high quantile of its past runtimes.

A reservation policy needs to know when running leases will end. Each job gets an `Estimate`:
`limit_s` is a bound the job cannot outlive (its timeout), `predicted_s` the best guess (the
timeout again, or a high quantile of the runtimes recorded for the same job key). A running
lease's expected end falls back from the prediction to the limit, and past the limit slides
forward by a fixed extension, so an overrunning job never makes the planner believe capacity
has already come back.

`RuntimeHistory` is plain data with a JSON form. Records are keyed by job id, so merging two
copies (two controllers, or a restart that re-reads an older copy) is a union that cannot
diverge: the same records always give the same history.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slurmgate.admission.labels import LabelError, parse_nodes
from slurmgate.admission.model import Job, JobStatus
from slurmgate.errors import InputError

HISTORY_FORMAT = 1
_SPACES = re.compile(r"\s+")


class HistoryError(InputError):
    """A serialised runtime history that does not follow the format."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """How long a job is expected to run (`predicted_s`) and the most it can run (`limit_s`)."""

    predicted_s: float
    limit_s: float

    def __post_init__(self) -> None:
        if not (self.predicted_s > 0 and self.limit_s > 0):
            raise ValueError(
                f"runtime estimate must be positive (predicted_s={self.predicted_s}, "
                f"limit_s={self.limit_s})"
            )
        if self.predicted_s > self.limit_s:
            object.__setattr__(self, "predicted_s", self.limit_s)


def expected_end(
    started_s: float, estimate: Estimate, now_s: float, extension_s: float, predicted: bool = True
) -> float:
    """When a lease that started at `started_s` is expected to free its runners, seen at `now_s`.

    A job still inside its prediction ends at start + prediction (with `predicted`; the
    reservation policies plan on timeouts and pass False). Past it, the timeout is the next
    bound (a learned quantile was too short, the user's limit still holds). Past the limit too
    (a timeout the controller does not know), the end slides to now + `extension_s`, so the
    job always looks as if it ends in the future and is never counted as free capacity.
    """
    if predicted:
        end = started_s + estimate.predicted_s
        if end > now_s:
            return end
    end = started_s + estimate.limit_s
    if end > now_s:
        return end
    return now_s + extension_s


def job_key(name: str, nodes: int) -> str:
    """The history key of a job: its name (GitHub puts matrix values in it) and node count.

    `benchmark (dsr1, 8k1k)` on 4 nodes and on 8 nodes are different keys; case and runs of
    whitespace do not matter. The ci-job token is not used: it is unique per matrix row and
    run, so it would never repeat.
    """
    return f"{_SPACES.sub(' ', name.strip()).casefold()}|n{nodes}"


def high_quantile(values: Iterable[float], q: float) -> float:
    """The nearest-rank q-quantile (q in (0, 1]): an observed value, never an interpolation."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(slots=True)
class RuntimeHistory:
    """Past runtimes per job key: the newest `keep` records per key, keyed by job id."""

    keep: int = 20
    records: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    # key -> {job id: (completed_at unix s, runtime s)}

    def record(self, key: str, job_id: int, runtime_s: float, completed_s: float) -> None:
        if runtime_s <= 0:
            return
        per_key = self.records.setdefault(key, {})
        per_key[job_id] = (float(completed_s), float(runtime_s))
        if len(per_key) > self.keep:
            newest = sorted(per_key.items(), key=lambda item: (item[1][0], item[0]))
            self.records[key] = dict(newest[-self.keep :])

    def learn(self, jobs: Iterable[Job], node_slots: bool = True) -> int:
        """Record every completed job that has both `started_at` and `completed_at`.

        Cancelled and skipped jobs are left out (their runtime says nothing about the next
        run); failures count, since they held their runners as long as they ran. Returns how
        many records were added or refreshed.
        """
        added = 0
        for job in jobs:
            if (
                job.status != JobStatus.COMPLETED
                or job.started_at is None
                or job.completed_at is None
                or job.conclusion in ("cancelled", "skipped")
            ):
                continue
            try:
                nodes = parse_nodes(job.labels) if node_slots else 1
            except LabelError:
                continue
            runtime = (job.completed_at - job.started_at).total_seconds()
            if runtime > 0:
                self.record(job_key(job.name, nodes), job.id, runtime, job.completed_at.timestamp())
                added += 1
        return added

    def runtimes(self, key: str) -> list[float]:
        return [runtime for _, runtime in self.records.get(key, {}).values()]

    def merge(self, other: RuntimeHistory) -> RuntimeHistory:
        """The union of both histories, trimmed per key; order of merging does not matter."""
        merged = RuntimeHistory(keep=min(self.keep, other.keep))
        for source in (self, other):
            for key, per_key in source.records.items():
                for job_id, (completed, runtime) in per_key.items():
                    merged.record(key, job_id, runtime, completed)
        return merged

    def to_json(self) -> dict[str, Any]:
        return {
            "format": HISTORY_FORMAT,
            "keep": self.keep,
            "jobs": {
                key: [
                    [job_id, completed, runtime]
                    for job_id, (completed, runtime) in sorted(v.items())
                ]
                for key, v in sorted(self.records.items())
            },
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> RuntimeHistory:
        """Parse the JSON form; a bad field raises HistoryError naming it and the fix."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise HistoryError(
                    f"runtime history is not JSON ({exc}); reset it to {{}}"
                ) from None
        if not isinstance(data, Mapping):
            raise HistoryError("runtime history must be a JSON object with 'format' and 'jobs'")
        if not data:
            return cls()
        if data.get("format") != HISTORY_FORMAT:
            raise HistoryError(
                f"runtime history field 'format' is {data.get('format')!r}; expected "
                f"{HISTORY_FORMAT} (reset the stored history to {{}} to start over)"
            )
        keep = data.get("keep", 20)
        if not isinstance(keep, int) or keep < 1:
            raise HistoryError(f"runtime history field 'keep' is {keep!r}; use an integer >= 1")
        jobs = data.get("jobs", {})
        if not isinstance(jobs, Mapping):
            raise HistoryError("runtime history field 'jobs' must map job keys to lists")
        history = cls(keep=keep)
        for key, rows in jobs.items():
            if not isinstance(rows, list):
                raise HistoryError(f"runtime history field 'jobs.{key}' must be a list")
            for row in rows:
                if (
                    not isinstance(row, list)
                    or len(row) != 3
                    or not all(isinstance(x, int | float) for x in row)
                ):
                    raise HistoryError(
                        f"runtime history field 'jobs.{key}' holds {row!r}; each entry is "
                        "[job id, completed unix s, runtime s]"
                    )
                history.record(str(key), int(row[0]), float(row[2]), float(row[1]))
        return history


@dataclass(frozen=True, slots=True)
class Estimator:
    """Turns a job (its key and timeout) into an Estimate, from the timeout or from history."""

    source: str = "timeout"  # "timeout" | "learned"
    quantile: float = 0.8
    min_samples: int = 3
    history: RuntimeHistory | None = None

    def estimate(self, key: str, limit_s: float) -> Estimate:
        if self.source == "learned" and self.history is not None:
            past = self.history.runtimes(key)
            if len(past) >= self.min_samples:
                return Estimate(min(limit_s, high_quantile(past, self.quantile)), limit_s)
        return Estimate(limit_s, limit_s)
