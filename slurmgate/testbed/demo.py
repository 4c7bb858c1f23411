"""The demo's pieces that need no Prefect: its jobs, its printer, its checks and its summary.

The demo itself (`flows/demo.py`) drives Prefect; everything it computes or prints is here.
"""

from __future__ import annotations

import csv
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmgate.ci.priority import job_label, queue_namespace, queue_token, score
from slurmgate.errors import ExternalError
from slurmgate.settings.handed import handed
from slurmgate.testbed.board import counted, render_compact, render_live
from slurmgate.testbed.emulator import fleet_from_job_mix

JOB_MIX = Path(__file__).resolve().parent.parent / "data" / "inferencex-job-mix.csv"

# scripts/demo.sh stamps its own start (epoch seconds) so that `total time` covers the whole
# command, setup and the Slurm start included, not just this process.
STARTED_AT_ENV = "SLURMGATE_DEMO_STARTED_AT"

# What one reconcile tick of the demo is, per --mode, in the words of its first line.
TICK_WORDS = {
    "deployment": "each tick runs the served `reconcile` deployment, as its 30 s schedule would",
    "direct": "each tick calls the `reconcile` flow in this process",
}


class DemoError(ExternalError):
    """A part of the demo failed; the message says which and why."""


@dataclass(frozen=True)
class DemoOptions:
    """What `slurmgate demo` was asked to do."""

    mode: str = "deployment"  # or "direct": the reconcile flow in this process
    load: float = 1.75  # queued nodes per pool runner
    never_fits: int = 2  # too-wide jobs per pool
    seed: int = 7
    duration_s: float = 4.0  # mean job seconds
    skip_runtime: bool = False
    skip_admission: bool = False
    live: bool | None = None  # None: a live view when stdout is a terminal
    workdir: Path | None = None  # None: a fresh temporary directory


# ---- the job mix ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoJob:
    row_id: str
    pool: str
    nodes: int
    score: str
    labels: list[str]
    duration_s: float


def _priority_row(row: dict[str, str], nodes: int) -> dict[str, Any]:
    """The mix row in the shape the priority policy scores (seed field names)."""
    recipe = (row.get("recipe") or "").lower()
    spec = next((s for s in ("eagle3", "eagle", "mtp") if s in recipe), "")
    return {
        "node-count": nodes,
        "prefill": {} if row.get("disagg") == "True" else None,
        "precision": row.get("precision", ""),
        "spec-decoding": spec,
        "framework": row.get("framework", ""),
        "model-prefix": (row.get("config_key") or "").split("-")[0],
        "scenario-type": row.get("scenario", ""),
    }


def draw_jobs(
    csv_path: Path = JOB_MIX,
    *,
    load: float = 1.75,
    never_fits: int = 2,
    seed: int = 7,
    duration_s: float = 4.0,
) -> list[DemoJob]:
    """Rows of the mix as queued jobs with runs-on labels, deterministic for a seed.

    Each pool gets rows that fit it until their nodes add up to `load` times its runners (so
    jobs wait and smaller ones backfill), and up to `never_fits` rows wider than the pool when
    the mix has any. Durations are `duration_s` times 0.75-1.5, so a pool turns over in seconds.
    """
    if load <= 0:
        raise DemoError(f"--load {load:g} must be above 0 (pool load factor, e.g. 2)")
    if never_fits < 0:
        raise DemoError(f"--never-fits {never_fits} must be 0 or more (too-wide jobs per pool)")
    if duration_s <= 0:
        raise DemoError(f"--duration {duration_s:g} must be above 0 (mean job seconds, e.g. 4)")
    pools = fleet_from_job_mix(csv_path)
    with open(csv_path, newline="") as fh:
        rows = [
            r
            for r in csv.DictReader(fh)
            if (r.get("cluster_pool") or "").startswith("cluster:")
            and (r.get("total_nodes") or "").isdigit()
        ]
    rng = random.Random(seed)
    picked: list[dict[str, str]] = []
    for pool, capacity in pools.items():
        mine = [r for r in rows if r["cluster_pool"] == f"cluster:{pool}"]
        fits = [r for r in mine if int(r["total_nodes"]) <= capacity]
        wide = [r for r in mine if int(r["total_nodes"]) > capacity]
        rng.shuffle(fits)
        nodes = 0
        for row in fits:
            if nodes >= load * capacity:
                break
            picked.append(row)
            nodes += int(row["total_nodes"])
        picked.extend(rng.sample(wide, min(never_fits, len(wide))))
    rng.shuffle(picked)  # arrival order is not priority order
    jobs = []
    for index, row in enumerate(picked):
        nodes = int(row["total_nodes"])
        pool = row["cluster_pool"].removeprefix("cluster:")
        value = score(_priority_row(row, nodes))
        token = queue_token(row, queue_namespace(seed, 1, "demo"), (str(index),))
        labels = [
            "self-hosted",
            f"cluster:{pool}",
            f"nodes:{nodes}",
            job_label(value, token),
            "ci-attempt-1",
        ]
        duration = round(duration_s * rng.uniform(0.75, 1.5), 2)
        jobs.append(DemoJob(row["row_id"], pool, nodes, str(value), labels, duration))
    return jobs


def command_started_at() -> float:
    """When the command began (epoch seconds): scripts/demo.sh's stamp, else this process's
    start, else now."""
    stamp = handed(STARTED_AT_ENV) or ""
    try:
        started = float(stamp)
    except ValueError:
        started = 0.0
    if 0 < started <= time.time():
        return started
    try:  # field 22 of /proc/self/stat: the process start, in clock ticks since boot
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and proc.poll() is not None:
            raise DemoError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.25)


# ---- results and what the demo prints --------------------------------------------------------


@dataclass
class AdmissionResult:
    jobs: int
    ticks: int
    admitted: int
    admitted_by_flow: int
    released_by_flow: int
    completed: int
    never_fits: dict[int, str]
    backfills: list[dict[str, Any]]
    peak_utilization: dict[str, float]
    capacity: dict[str, int]
    api_calls: int
    api_calls_by_flow: int
    leases_left: int
    seconds: float
    mode: str
    problems: list[str] = field(default_factory=list)


class Printer:
    """A rich Live view on a terminal, one compact block per tick otherwise."""

    def __init__(self, live: bool | None = None) -> None:
        from rich.console import Console

        self.console = Console()
        self.live_mode = self.console.is_terminal if live is None else live
        self.events: list[str] = []
        self.highlights: list[str] = []  # backfills and never-fits stay on screen longer
        self._live: Any = None

    def __enter__(self) -> Printer:
        if self.live_mode:
            from rich.live import Live

            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def show(self, view: Any, *, running: bool = False) -> None:
        """Show a tick's view; `running` marks a refresh while the tick is still in flight."""
        if self._live is not None:
            for event in view.events:
                notable = event.startswith("BACKFILL") or "can never run" in event
                (self.highlights if notable else self.events).append(event)
            self.events, self.highlights = self.events[-5:], self.highlights[-6:]
            shown = self.highlights + self.events
            self._live.update(render_live(view, shown, running=running))
        elif not running:
            print(render_compact(view), flush=True)

    def say(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, flush=True)


def api_calls(stats: dict[str, Any]) -> int:
    return sum(n for k, n in stats.get("requests", {}).items() if "/_emulator" not in k)


@dataclass
class RuntimeResult:
    run_id: str = ""
    job_id: str = ""
    hosts: list[str] = field(default_factory=list)
    loadgen: dict[str, dict[str, Any]] = field(default_factory=dict)
    served: int = 0
    throttled_429: int = 0
    endpoint_requests: int = 0
    cleanup_complete: bool = False
    leftover_processes: list[int] = field(default_factory=list)
    slurm_job_left: bool = False
    allocation_wait_s: float | None = None  # salloc asked -> Slurm granted the nodes
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    link: AdmissionLink | None = None  # how the run's CI job was admitted and dispatched


# salloc asked -> granted is Slurm's queue: one salloc when Slurm has the nodes the controller
# counted (the Slurm capacity test measures 0.006-0.015 s). Above the bound the allocation
# waited for nodes the controller believed free.
STARTUP_BOUND_S = 2.0
# Dispatch -> grant adds the job's own startup (a Prefect flow run created, the spec read),
# seconds on a loaded machine; beyond this bound the allocation did not start at the dispatch.
OWN_STARTUP_BOUND_S = 30.0


@dataclass
class AdmissionLink:
    """The runtime part's CI job on its own emulator: admitted by the reconcile flow with Slurm's
    capacity read, dispatched to its anchor, allocated at dispatch; wall-clock instants."""

    pool: str = ""
    partition: str = ""
    job_id: int | None = None
    anchor: str = ""
    admitted_by_flow: int = 0  # the reconcile runs' own counts
    released_by_flow: int = 0
    slurm_capacity: str = (
        ""  # the board's slurm column for the pool, as the admitting tick wrote it
    )
    leases_left: int | None = None
    dispatched_at: float | None = None  # the emulator handed the job to its anchor runner
    flow_started_at: float | None = None  # the demo called the allocation flow
    salloc_asked_at: float | None = None  # the run asked Slurm (its record's timings)
    granted_at: float | None = None  # salloc returned with the granted job
    completed: bool = False  # the job was completed on the emulator when the allocation ended
    admission_s: float = 0.0  # what the link adds to the runtime part: emulator up to dispatch
    release_s: float = 0.0  # and the releasing tick(s)

    def span(self, start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round(end - start, 4)

    @property
    def dispatch_to_grant_s(self) -> float | None:
        return self.span(self.dispatched_at, self.granted_at)

    @property
    def queue_wait_s(self) -> float | None:
        """salloc asked -> Slurm granted: the wait in Slurm's queue (with salloc's own time)."""
        return self.span(self.salloc_asked_at, self.granted_at)


def invariant_line(link: AdmissionLink) -> str:
    """The summary's measurement of the invariant, with its parts."""
    total, wait = link.dispatch_to_grant_s, link.queue_wait_s
    if total is None or wait is None:
        return f"invariant: not measured (job {link.job_id or '-'}: no dispatch or no grant)"
    wake = link.span(link.dispatched_at, link.flow_started_at)
    flow = link.span(link.flow_started_at, link.salloc_asked_at)
    return (
        f"invariant: job {link.job_id} dispatched to {link.anchor}; its Slurm allocation "
        f"started {total:.3f} s later (salloc asked -> granted {wait:.3f} s; the rest is the "
        f"job's own startup: dispatch -> allocation flow called {wake:.3f} s, flow -> salloc "
        f"asked {flow:.3f} s)"
    )


def link_problems(link: AdmissionLink) -> list[str]:
    """What the linked admission got wrong: no admission through the flow, no Slurm capacity
    read, a grant outside the bound (or before the dispatch), a lease left."""
    problems: list[str] = []
    if link.admitted_by_flow != 1:
        problems.append(
            f"the runtime's CI job: the reconcile runs admitted {link.admitted_by_flow}, not 1"
        )
    if f"partition {link.partition}" not in link.slurm_capacity:
        problems.append(
            f"the runtime's CI job was admitted without Slurm's capacity for pool {link.pool} "
            f"(board: {link.slurm_capacity or 'no slurm column'})"
        )
    total, wait = link.dispatch_to_grant_s, link.queue_wait_s
    if total is None or wait is None:
        problems.append(f"the runtime's CI job {link.job_id}: dispatch or grant not recorded")
    else:
        if total < 0:
            problems.append(
                f"Slurm granted job {link.job_id}'s allocation {-total:.3f} s before its dispatch"
            )
        elif total > OWN_STARTUP_BOUND_S:
            problems.append(
                f"Slurm granted job {link.job_id}'s allocation {total:.3f} s after its dispatch "
                f"(bound {OWN_STARTUP_BOUND_S:g} s): the allocation did not start at the dispatch"
            )
        if wait > STARTUP_BOUND_S:
            problems.append(
                f"job {link.job_id}'s allocation waited {wait:.3f} s in Slurm's queue for nodes "
                f"the controller believed free (bound {STARTUP_BOUND_S:g} s)"
            )
    if not link.completed:
        problems.append(f"the runtime's CI job {link.job_id} was not completed on the emulator")
    if link.released_by_flow != 1 or link.leases_left != 0:
        problems.append(
            f"the runtime's CI job: {link.released_by_flow} lease released by the reconcile "
            f"runs, {link.leases_left} left"
        )
    return problems


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids whose environment holds KEY=VALUE (the runtime tags every step with its run id)."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def endpoint_totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Requests, 200s and 429s answered by the logical endpoints, from their metric rows."""
    totals = {"requests": 0, "served": 0, "throttled": 0}
    for row in rows:
        value = int(float(row.get("value", 0)))
        metric, labels = str(row.get("metric", "")), str(row.get("labels", ""))
        if metric == "slurmgate_endpoint_requests_total":
            totals["requests"] += value
        elif metric == "slurmgate_endpoint_responses_total" and "status=200" in labels:
            totals["served"] += value
        elif metric == "slurmgate_endpoint_responses_total" and "status=429" in labels:
            totals["throttled"] += value
    return totals


def runtime_problems(result: RuntimeResult) -> list[str]:
    """What a finished runtime part got wrong, from what the demo observed."""
    problems: list[str] = []
    if not result.cleanup_complete:
        problems.append("the run record does not say cleanup completed")
    if result.leftover_processes:
        problems.append(f"processes of the run still alive: {result.leftover_processes}")
    if result.slurm_job_left:
        problems.append(f"Slurm job {result.job_id} is still in the queue")
    if result.served == 0:
        problems.append("the endpoints served no request")
    if result.throttled_429 == 0:
        problems.append("the overload drew no 429 from the endpoint")
    throttled = sum(int(r.get("throttled", 0)) for r in result.loadgen.values())
    if throttled != result.throttled_429:
        problems.append(
            f"loadgen counted {throttled} 429s but the endpoints report {result.throttled_429}"
        )
    return problems


def summary_lines(
    adm: AdmissionResult | None, rt: RuntimeResult | None, total_s: float
) -> list[str]:
    lines = ["", "== slurmgate demo summary"]
    if adm is not None:
        lines.append(
            f"admission ({adm.mode}): {counted(adm.jobs, 'job')} queued, {adm.admitted} admitted "
            f"({adm.admitted_by_flow} by the reconcile runs), {adm.completed} completed, "
            f"{len(adm.never_fits)} never fit, {counted(len(adm.backfills), 'backfill')}, "
            f"{counted(adm.ticks, 'tick')} in {adm.seconds:.0f} s, "
            f"{counted(adm.leases_left, 'lease')} left"
        )
        lines.append(
            f"API calls used: {adm.api_calls} (the emulator counted; the flows counted "
            f"{adm.api_calls_by_flow})"
        )
        lines.append(
            "peak utilization: "
            + ", ".join(
                f"{pool} {adm.peak_utilization.get(pool, 0.0):.0%} of {cap}"
                for pool, cap in adm.capacity.items()
            )
        )
        for b in adm.backfills[:3]:
            lines.append(
                f"  backfill: job {b['job_id']} ({b['nodes']}n) ran in {b['pool']} while job "
                f"{b['past_job_id']} ({b['past_nodes']}n, higher score {b['past_score']}) waited"
            )
    if rt is not None:
        lines.append(
            f"runtime: run {rt.run_id or '-'} (Slurm job {rt.job_id or '-'} on "
            f"{','.join(rt.hosts) or '-'}) in {rt.seconds:.0f} s: {rt.served} requests served, "
            f"{rt.throttled_429} answered 429, {rt.endpoint_requests} received by the endpoints"
        )
        if rt.link is not None:
            link = rt.link
            lines.append(
                f"  admission: job {link.job_id or '-'} (nodes:{len(rt.hosts) or '?'}, "
                f"cluster:{link.pool}) admitted by the reconcile flow with Slurm's capacity "
                f"({link.slurm_capacity or '-'}), completed when the allocation ended, "
                f"{link.released_by_flow} lease released, "
                f"{'?' if link.leases_left is None else link.leases_left} left"
            )
        if rt.allocation_wait_s is not None:
            lines.append(
                f"  allocation: Slurm granted its {len(rt.hosts) or '?'} node(s) "
                f"{rt.allocation_wait_s:.3f} s after salloc asked"
            )
        if rt.link is not None:
            lines.append(invariant_line(rt.link))
        for name, report in sorted(rt.loadgen.items()):
            lines.append(
                f"  loadgen {name}: {report.get('ok')} ok, {report.get('throttled')} throttled, "
                f"{report.get('throughput', 0):.0f} req/s, p50 "
                f"{report.get('latency_p50', 0) * 1e3:.0f} ms"
            )
        verified = rt.cleanup_complete and not rt.leftover_processes and not rt.slurm_job_left
        lines.append(
            f"cleanup verified: {'yes' if verified else 'NO'} (record says complete: "
            f"{rt.cleanup_complete}; processes of the run left: {len(rt.leftover_processes)}; "
            f"Slurm job left: {rt.slurm_job_left})"
        )
    lines.append(f"total time: {total_s:.0f} s (the whole command)")
    problems = (adm.problems if adm else []) + (rt.problems if rt else [])
    lines.extend(f"!! {p}" for p in problems)
    lines.append("demo: FAILED" if problems else "demo: OK")
    return lines
