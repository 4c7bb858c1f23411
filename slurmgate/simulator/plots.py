"""Charts of replays (matplotlib, `plots` extra): wait CDFs, wide-job waits, a pool's Gantt day."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurmgate.errors import ExternalError
from slurmgate.simulator.metrics import Run


class PlotError(ExternalError):
    """Plotting needs matplotlib."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise PlotError("--plot needs matplotlib: pip install 'slurmgate[plots]'") from None
    return plt


def busiest_day(runs: Sequence[Run], pool: str) -> float:
    """Start (s) of the 24 h window of `pool` whose starting jobs waited longest in total."""
    per_day: dict[int, float] = {}
    for run in runs:
        if run.pool == pool:
            day = int(run.start_s // 86400)
            per_day[day] = per_day.get(day, 0.0) + run.wait_s * run.nodes
    if not per_day:
        return 0.0
    return max(per_day, key=lambda d: (per_day[d], -d)) * 86400.0


def gantt(
    runs: Sequence[Run],
    path: Path | str,
    *,
    pool: str | None = None,
    start_s: float | None = None,
    span_s: float = 86400.0,
    wide_above: float = 0.0,
    title: str = "",
) -> Path:
    """One pool's runners over a day, each lease a bar; wide jobs red, others by size."""
    plt = _pyplot()
    from matplotlib.collections import PolyCollection

    if pool is None:
        sizes: dict[str, int] = {}
        for run in runs:
            sizes[run.pool] = sizes.get(run.pool, 0) + run.nodes * int(run.runtime_s)
        pool = max(sizes, key=lambda p: (sizes[p], p))
    if start_s is None:
        start_s = busiest_day(runs, pool)
    end_s = start_s + span_s
    shown = [r for r in runs if r.pool == pool and r.start_s < end_s and r.end_s > start_s]
    runner_ids = sorted({rid for r in runs if r.pool == pool for rid in r.runner_ids})
    row = {rid: i for i, rid in enumerate(runner_ids)}
    fig, ax = plt.subplots(figsize=(12, max(3.0, len(runner_ids) * 0.06 + 2)))
    cmap = plt.get_cmap("viridis")
    biggest = max((r.nodes for r in shown), default=1)
    labelled: list[tuple[float, float]] = []
    # every bar in one collection, drawn in this order: a call per bar costs a second per
    # thousand bars
    bars: list[list[tuple[float, float]]] = []
    colors: list[Any] = []
    for run in sorted(shown, key=lambda r: -r.wait_s):
        left = (max(run.start_s, start_s) - start_s) / 3600
        width = (min(run.end_s, end_s) - max(run.start_s, start_s)) / 3600
        wide = bool(wide_above) and run.nodes > wide_above
        color = "#d62728" if wide else cmap(0.15 + 0.7 * run.nodes / biggest)
        for rid in run.runner_ids:
            bottom, top = row[rid] - 0.4, row[rid] + 0.4
            bars.append([(left, bottom), (left, top), (left + width, top), (left + width, bottom)])
            colors.append(color)
        middle = sum(row[rid] for rid in run.runner_ids) / len(run.runner_ids)
        crowded = any(abs(left - x) < 1.5 and abs(middle - y) < 6 for x, y in labelled)
        if wide and run.wait_s >= 3600 and run.start_s >= start_s and not crowded:
            labelled.append((left, middle))
            ax.annotate(
                f"{run.nodes}n, waited {run.wait_s / 3600:.0f}h",
                (left + 0.05, middle),
                fontsize=7,
                color="white",
                va="center",
            )
    ax.add_collection(PolyCollection(bars, facecolors=colors, edgecolors="white", linewidths=0.2))
    ax.set_xlim(0, span_s / 3600)
    ax.set_ylim(-1, len(runner_ids))
    ax.set_xlabel(f"hours from t={start_s / 3600:.0f} h")
    ax.set_ylabel(f"runner of {pool}")
    ax.set_title(title or f"{pool}: leases over the busiest day (red: wide jobs)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def wait_cdf(waits_h: Mapping[str, Sequence[float]], path: Path | str, title: str) -> Path:
    """Empirical CDF of waits (hours, log x) per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, values in waits_h.items():
        ordered = sorted(max(v, 1 / 60) for v in values)
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("wait (hours, waits under a minute drawn at 1 min)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def wide_waits(
    series: Mapping[str, Sequence[tuple[float, float]]], path: Path | str, title: str
) -> Path:
    """Wide jobs' waits (hours) against their submit day, per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, points in series.items():
        ax.scatter([d for d, _ in points], [w for _, w in points], s=6, label=label, alpha=0.6)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlabel("submit (days)")
    ax.set_ylabel("wide-job wait (hours)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(markerscale=3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
