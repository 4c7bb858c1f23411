"""The demo's pool board: track admission tick by tick and render it with rich (live or compact).

Pure: it reads an emulator state dump (`GET /_emulator/state`, GitHub's runner and job JSON) and
the reconcile flow's board rows (the `slurmgate-pool-board` artifact), and keeps what the demo
summary needs: admissions, backfills, never-fits, releases and the peak utilization per pool.
A backfill is a job admitted while a higher-priority job of the same pool stays blocked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from slurmgate.admission.labels import (
    CLUSTER_PREFIX,
    JobLabel,
    LabelError,
    LeaseLabel,
    fold,
    is_lease,
)

PERMANENT_REASONS = frozenset(
    {"larger-than-any-compatible-pool", "no-compatible-pool", "bad-input"}
)
"""Blocked reasons that no amount of waiting fixes: the demo does not wait for these jobs."""

_BLOCKED_RE = re.compile(r"job (?P<job>\d+) \((?P<nodes>\d+|\?)n\): (?P<reason>[a-z-]+)")


@dataclass(frozen=True, slots=True)
class BlockedJob:
    job_id: int
    nodes: int | None
    reason: str
    score: Decimal | None


@dataclass(frozen=True, slots=True)
class Backfill:
    tick: int
    pool: str
    job_id: int
    nodes: int
    score: Decimal | None
    past_job_id: int
    past_nodes: int | None
    past_score: Decimal | None


@dataclass
class PoolState:
    """One pool after a tick: capacity from the fleet, leases, running and blocked jobs."""

    pool: str
    runners: int = 0
    online: int = 0
    leased: int = 0
    leases: int = 0
    running: int = 0
    blocked: list[BlockedJob] = field(default_factory=list)
    peak_utilization: float = 0.0
    slurm: str = ""  # a pool mapped to a partition: usable nodes, and why the rest are missing

    @property
    def utilization(self) -> float:
        return self.leased / self.online if self.online else 0.0


@dataclass
class TickView:
    """What the live view shows after one reconcile tick."""

    tick: int
    elapsed_s: float
    pools: list[PoolState]
    events: list[str]
    admitted_total: int
    completed_total: int
    queued_total: int
    api_calls: int
    never_fits: int
    backfills_total: int


def score_of(labels: Iterable[str]) -> Decimal | None:
    """The priority carried by a job's `ci-job-<score>-<token>` runs-on label, if any."""
    for label in labels:
        try:
            return JobLabel.parse(label).score
        except LabelError:
            continue
    return None


def nodes_of(labels: Iterable[str]) -> int:
    for label in labels:
        folded = fold(label)
        if folded.startswith("nodes:") and folded[6:].isdigit():
            return int(folded[6:])
    return 1


def pool_of_job(labels: Iterable[str]) -> str | None:
    for label in labels:
        if fold(label).startswith(CLUSTER_PREFIX):
            return fold(label)[len(CLUSTER_PREFIX) :]
    return None


def parse_board_blocked(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[int, str]]]:
    """Blocked (job id, reason) per pool from the reconcile board rows' `blocked` column."""
    blocked: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        text = str(row.get("blocked") or "")
        for match in _BLOCKED_RE.finditer(text):
            pool = fold(str(row.get("pool"))).removeprefix(CLUSTER_PREFIX)
            blocked.setdefault(pool, []).append((int(match["job"]), match["reason"]))
    return blocked


def parse_board_slurm(rows: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """What Slurm said of each pool's partition, from the board rows' `slurm` column."""
    return {
        fold(str(row.get("pool"))).removeprefix(CLUSTER_PREFIX): str(row["slurm"])
        for row in rows
        if row.get("slurm")
    }


def _label_names(item: Mapping[str, Any]) -> list[str]:
    return [str(x["name"]) if isinstance(x, Mapping) else str(x) for x in item.get("labels", [])]


class AdmissionTracker:
    """Follows the fleet across ticks; every number of the admission summary comes from here."""

    def __init__(self, job_ids: Iterable[int] | None = None) -> None:
        self.job_ids: set[int] | None = set(job_ids) if job_ids is not None else None
        self.admitted: dict[int, int] = {}  # job id -> tick of its first lease
        self.released: set[int] = set()
        self.completed: set[int] = set()
        self.never_fits: dict[int, str] = {}
        self.backfills: list[Backfill] = []
        self.peak: dict[str, float] = {}
        self.peak_leased: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self._leased_before: set[int] = set()
        self._last_blocked: dict[str, list[BlockedJob]] = {}
        self.ticks = 0

    def _ours(self, job_id: int) -> bool:
        return self.job_ids is None or job_id in self.job_ids

    def _fleet(
        self, dump: Mapping[str, Any]
    ) -> tuple[dict[str, PoolState], set[int], dict[int, Mapping[str, Any]]]:
        """Pools (capacity, leased runners, leases, running jobs), leased job ids, our jobs."""
        jobs = {int(j["id"]): j for j in dump.get("jobs", []) if self._ours(int(j["id"]))}
        pools: dict[str, PoolState] = {}
        leased_jobs: set[int] = set()
        lease_labels: dict[str, set[str]] = {}
        for runner in dump.get("runners", []):
            names = _label_names(runner)
            pool = pool_of_job(names)
            if pool is None:
                continue
            state = pools.setdefault(pool, PoolState(pool))
            state.runners += 1
            state.online += runner.get("status") == "online"
            leases = [fold(n) for n in names if is_lease(n)]
            if leases:
                state.leased += 1
            for label in leases:
                try:
                    job_id = LeaseLabel.parse(label).job_id
                except LabelError:
                    continue
                lease_labels.setdefault(pool, set()).add(label)
                if self._ours(job_id):
                    leased_jobs.add(job_id)
        for pool, held in lease_labels.items():
            pools[pool].leases = len(held)
        for job in jobs.values():
            if job.get("status") == "in_progress":
                pool = pool_of_job(_label_names(job))
                if pool in pools:
                    pools[pool].running += 1
        return pools, leased_jobs, jobs

    def _finish(self, pools: dict[str, PoolState]) -> list[PoolState]:
        for state in pools.values():
            state.blocked.sort(key=lambda b: (-(b.score or Decimal(0)), b.job_id))
            self.capacity[state.pool] = state.online
            if state.utilization >= self.peak.get(state.pool, 0.0):
                self.peak[state.pool] = state.utilization
                self.peak_leased[state.pool] = max(
                    state.leased, self.peak_leased.get(state.pool, 0)
                )
            state.peak_utilization = self.peak[state.pool]
        return sorted(pools.values(), key=lambda p: p.pool)

    def peek(
        self, tick: int, dump: Mapping[str, Any], *, elapsed_s: float = 0.0, api_calls: int = 0
    ) -> TickView:
        """The fleet while a tick runs: leases and peaks move, blocked jobs are the last tick's."""
        pools, _, jobs = self._fleet(dump)
        for pool, blocked in self._last_blocked.items():
            pools.setdefault(pool, PoolState(pool)).blocked = list(blocked)
        return TickView(
            tick=tick,
            elapsed_s=elapsed_s,
            pools=self._finish(pools),
            events=[],
            admitted_total=len(self.admitted),
            completed_total=len(self.completed),
            queued_total=sum(1 for j in jobs.values() if j.get("status") == "queued"),
            api_calls=api_calls,
            never_fits=len(self.never_fits),
            backfills_total=len(self.backfills),
        )

    def observe(
        self,
        tick: int,
        dump: Mapping[str, Any],
        board_rows: Iterable[Mapping[str, Any]],
        *,
        elapsed_s: float = 0.0,
        api_calls: int = 0,
    ) -> TickView:
        """Fold one tick in: `dump` is the emulator state just after the reconcile run, and
        `board_rows` the board that run wrote (its blocked jobs and their reasons)."""
        self.ticks = max(self.ticks, tick)
        pools, leased_jobs, jobs = self._fleet(dump)
        events: list[str] = []
        new = sorted(leased_jobs - set(self.admitted))
        for job_id in new:
            self.admitted[job_id] = tick
        for job in jobs.values():
            if job.get("status") == "completed" and int(job["id"]) in self.admitted:
                self.completed.add(int(job["id"]))
        ended = sorted(self._leased_before - leased_jobs)
        self.released.update(ended)
        if ended:
            shown = ", ".join(str(j) for j in ended[:8]) + (" ..." if len(ended) > 8 else "")
            events.append(f"released {counted(len(ended), 'lease')} of finished jobs: {shown}")
        self._leased_before = leased_jobs

        board_rows = list(board_rows)
        for pool_name, said in parse_board_slurm(board_rows).items():
            pools.setdefault(pool_name, PoolState(pool_name)).slurm = said
        blocked = parse_board_blocked(board_rows)
        for pool_name, entries in blocked.items():
            state = pools.setdefault(pool_name, PoolState(pool_name))
            for job_id, reason in entries:
                if not self._ours(job_id) or job_id not in jobs:
                    continue
                names = _label_names(jobs[job_id])
                state.blocked.append(BlockedJob(job_id, nodes_of(names), reason, score_of(names)))
                if reason in PERMANENT_REASONS and job_id not in self.never_fits:
                    self.never_fits[job_id] = reason
                    events.append(
                        f"job {job_id} ({nodes_of(names)}n) can never run in {pool_name}: {reason}"
                    )

        for job_id in new:
            names = _label_names(jobs[job_id]) if job_id in jobs else []
            pool = pool_of_job(names) or "?"
            score = score_of(names)
            nodes = nodes_of(names)
            events.append(f"admitted job {job_id} ({nodes}n, score {score}) in {pool}")
            waiting = [
                b
                for b in (pools[pool].blocked if pool in pools else [])
                if b.reason not in PERMANENT_REASONS
                and b.score is not None
                and score is not None
                and b.score > score
            ]
            if waiting:
                top = max(waiting, key=lambda b: (b.score or Decimal(0), -(b.nodes or 0)))
                self.backfills.append(
                    Backfill(tick, pool, job_id, nodes, score, top.job_id, top.nodes, top.score)
                )
                events.append(
                    f"BACKFILL job {job_id} ({nodes}n, score {score}) runs while job "
                    f"{top.job_id} ({top.nodes}n, score {top.score}) waits in {pool}"
                )

        self._last_blocked = {p: list(st.blocked) for p, st in pools.items() if st.blocked}
        finished = self._finish(pools)
        queued = sum(1 for j in jobs.values() if j.get("status") == "queued")
        return TickView(
            tick=tick,
            elapsed_s=elapsed_s,
            pools=finished,
            events=events,
            admitted_total=len(self.admitted),
            completed_total=len(self.completed),
            queued_total=queued,
            api_calls=api_calls,
            never_fits=len(self.never_fits),
            backfills_total=len(self.backfills),
        )


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 lease`, `2 leases`: a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _bar(used: int, total: int, width: int = 20) -> Text:
    filled = round(width * used / total) if total else 0
    bar = Text("█" * filled, style="green" if used < total else "yellow")
    bar.append("·" * (width - filled), style="dim")
    return bar


def _blocked_text(state: PoolState, limit: int = 3) -> str:
    parts = [f"{b.job_id} {b.nodes}n s{b.score}: {b.reason}" for b in state.blocked[:limit]]
    if len(state.blocked) > limit:
        parts.append(f"+{len(state.blocked) - limit} more")
    if state.slurm:
        parts.append(f"slurm: {state.slurm}")
    return "\n".join(parts)


def render_live(view: TickView, recent_events: list[str], *, running: bool = False) -> Group:
    """The rich renderable of the live view: one row per pool, then the latest events."""
    state_word = "running" if running else "done"
    table = Table(
        title=(
            f"slurmgate admission — tick {view.tick} {state_word}, {view.elapsed_s:.0f} s — "
            f"admitted {view.admitted_total}, done {view.completed_total}, "
            f"queued {view.queued_total}, backfills {view.backfills_total}, "
            f"API calls {view.api_calls}"
        ),
        title_justify="left",
    )
    table.add_column("pool")
    table.add_column("leased / online", no_wrap=True)
    table.add_column("leases", justify="right")
    table.add_column("running", justify="right")
    table.add_column("peak", justify="right")
    table.add_column("blocked (job, nodes, score: reason)")
    for state in view.pools:
        cell = _bar(state.leased, state.online)
        cell.append(f" {state.leased}/{state.online}")
        table.add_row(
            state.pool,
            cell,
            str(state.leases),
            str(state.running),
            f"{state.peak_utilization:.0%}",
            _blocked_text(state),
        )
    lines = Text()
    for event in recent_events:
        style = "bold magenta" if event.startswith("BACKFILL") else ""
        if "can never run" in event:
            style = "red"
        lines.append(event + "\n", style=style)
    return Group(table, lines)


def render_compact(view: TickView) -> str:
    """One compact block per tick for pipes and CI logs."""
    head = (
        f"tick {view.tick} t={view.elapsed_s:.1f}s admitted={view.admitted_total} "
        f"done={view.completed_total} queued={view.queued_total} "
        f"backfills={view.backfills_total} never-fits={view.never_fits} api={view.api_calls}"
    )
    lines = [head]
    for state in view.pools:
        blocked = ", ".join(f"{b.job_id}:{b.nodes}n:{b.reason}" for b in state.blocked[:4])
        more = f" +{len(state.blocked) - 4}" if len(state.blocked) > 4 else ""
        lines.append(
            f"  {state.pool:<14} {state.leased:>2}/{state.online:<2} leased "
            f"({counted(state.leases, 'lease')}, {state.running} running, peak "
            f"{state.peak_utilization:.0%})" + (f" blocked: {blocked}{more}" if blocked else "")
        )
        if state.slurm:
            lines.append(f"    slurm: {state.slurm}")
    lines.extend(f"  * {event}" for event in view.events)
    return "\n".join(lines)
