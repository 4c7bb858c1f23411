"""Schedule-quality metrics of a replay: waits, bounded slowdown, utilization, makespan bound."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TAU_S = 10.0
"""Bounded-slowdown threshold (Feitelson et al. 1997): runtimes below it count as 10 s."""


@dataclass(frozen=True, slots=True)
class Run:
    """One replayed job: when it was submitted and started, how long it ran, where."""

    job_id: int
    submit_s: float
    start_s: float
    runtime_s: float
    nodes: int
    pool: str
    runner_ids: tuple[int, ...]

    @property
    def wait_s(self) -> float:
        return self.start_s - self.submit_s

    @property
    def end_s(self) -> float:
        return self.start_s + self.runtime_s


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100), numpy's default method."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def bounded_slowdown(run: Run) -> float:
    return max(1.0, (run.wait_s + run.runtime_s) / max(run.runtime_s, TAU_S))


def summarize(
    runs: Sequence[Run], capacity: int, wide_above: float, rejected: int = 0
) -> dict[str, Any]:
    """The metrics of one replay; times in hours, makespans in days.

    `wide_above` is the node count a job must exceed to count as wide (wide-frac x the largest
    pool). Utilization is work / (capacity x makespan); the makespan lower bound is
    max(work / capacity, latest submit + runtime), both from the first submit.
    """
    if not runs:
        return {"jobs": 0, "rejected": rejected}
    hour = 3600.0
    first = min(r.submit_s for r in runs)
    makespan = max(r.end_s for r in runs) - first
    work = sum(r.nodes * r.runtime_s for r in runs)
    bound = max(work / capacity, max(r.submit_s + r.runtime_s for r in runs) - first)
    waits = [r.wait_s / hour for r in runs]
    bslds = [bounded_slowdown(r) for r in runs]
    wide = [r.wait_s / hour for r in runs if r.nodes > wide_above]
    small = [r.wait_s / hour for r in runs if r.nodes <= wide_above]
    return {
        "jobs": len(runs),
        "rejected": rejected,
        "utilization": work / (capacity * makespan) if makespan > 0 else 0.0,
        "makespan_d": makespan / 86400,
        "makespan_lower_bound_d": bound / 86400,
        "makespan_over_bound": makespan / bound if bound > 0 else 1.0,
        "utilization_bound": work / (capacity * bound) if bound > 0 else 0.0,
        "mean_wait_h": sum(waits) / len(waits),
        "median_wait_h": percentile(waits, 50),
        "p95_wait_h": percentile(waits, 95),
        "max_wait_h": max(waits),
        "mean_bsld": sum(bslds) / len(bslds),
        "p95_bsld": percentile(bslds, 95),
        "wide_above_nodes": wide_above,
        "wide_jobs": len(wide),
        "wide_mean_wait_h": sum(wide) / len(wide) if wide else 0.0,
        "wide_max_wait_h": max(wide) if wide else 0.0,
        "small_mean_wait_h": sum(small) / len(small) if small else 0.0,
    }
