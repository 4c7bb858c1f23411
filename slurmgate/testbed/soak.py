"""A soak on the GitHub emulator: two controllers, random faults and SIGKILLs, invariants per tick.

Time is compressed: one virtual clock, `origin + (wall - origin) * speed`, is shared by the
emulator (job arrivals, durations, completions) and by the controllers (their tick schedule and
the planner's `now`, hence every lease label's stamp). Client timeouts, backoffs and Retry-After
waits stay in wall seconds, so a fault costs `speed` times more virtual time than it would at 1x:
the compression makes the controllers slower relative to the fleet, never faster.

Each controller is a child process (`python -m slurmgate.testbed.soak controller ...`) running
the real `reconcile_tick` over `direct_steps` on its own schedule. It prints one JSON line when
a tick starts and one when it ends; after every end, the checker reads the emulator's state
directly (never through the faulted API) and checks the invariants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, Field

from slurmgate.admission.batch_verify import BatchShare
from slurmgate.admission.labels import (
    ATTEMPT_PREFIX,
    NODES_PREFIX,
    JobLabel,
    LabelError,
    LeaseLabel,
    fold,
    is_anchor_label,
    is_lease,
    is_managed,
)
from slurmgate.admission.leases import AdmitOutcome, AnchorDeadline, admit_lease
from slurmgate.admission.model import Admit
from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.errors import one_line
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.simulator.traces import read_job_mix
from slurmgate.testbed.emulator.server import BackgroundServer
from slurmgate.testbed.emulator.state import EmuJob, EmulatorState, FaultPlan, build_state

REPO = "acme/gpu-ci"
TOKEN = "soak-token"
# Four pools of the InferenceX mix whose rows all fit in 50 runners, 200 runners in all.
SOAK_POOLS = {"gb200-nv": 50, "gb300-nv": 50, "b300-nv": 50, "h200-dgxc": 50}
# Unmanaged labels every runner carries, named to sit next to the managed families: a removal
# that matched on a prefix without its dash, or on a substring, would take one of these.
DECOY_LABELS = ("ci-leases-audit", "ci-jobs", "nodes", "rack-ci-lease-7")
EVIDENCE_KEPT = 12
DRAIN_WALL_S = 60.0  # at the end, how long to wait for ticks in flight (and for a first tick)


class SoakConfig(BaseModel):
    """One soak: the fleet, the workload, the faults, the two controllers and the kills."""

    seed: int = 17
    sim_s: float = Field(7200.0, gt=0, description="simulated seconds the soak covers")
    speed: float = Field(20.0, gt=0, description="simulated seconds per wall second")
    pools: dict[str, int] = Field(default_factory=lambda: dict(SOAK_POOLS))
    offered_load: float = Field(1.3, gt=0, description="node-seconds queued / capacity")
    runtime_scale: float = Field(1.0, gt=0, description="scales the mix's job runtimes")
    fault_rate: float = Field(0.05, ge=0, le=1)
    retry_after_s: float = Field(0.25, ge=0, description="wall seconds a rate limit asks for")
    timeout_delay_s: float = Field(0.8, ge=0, description="wall seconds a timeout fault waits")
    client_timeout_s: float = Field(0.5, gt=0, description="the controllers' client timeout")
    tick_periods_s: tuple[float, float] = (30.0, 37.0)
    kill_mean_s: float | None = Field(
        600.0, gt=0, description="mean simulated seconds between SIGKILLs; None: no kills"
    )
    orphan_grace_s: float = 30.0

    def fault_plan(self) -> FaultPlan:
        return FaultPlan(
            rate=self.fault_rate,
            seed=self.seed,
            retry_after_s=self.retry_after_s,
            delay_s=self.timeout_delay_s,
        )


# ---- the virtual clock ---------------------------------------------------------------------------


@dataclass(frozen=True)
class VirtualClock:
    """Virtual seconds since the epoch: `origin` at wall time `origin`, running `speed` times."""

    origin: float
    speed: float

    def now(self) -> float:
        return self.origin + (time.time() - self.origin) * self.speed

    def now_dt(self) -> datetime:
        return datetime.fromtimestamp(self.now(), UTC)

    def wall_until(self, virtual: float) -> float:
        """Wall seconds until the clock shows `virtual` (0 when it already has)."""
        return max(0.0, (virtual - self.now()) / self.speed)


# ---- the workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakJob:
    """One job to queue: when (virtual seconds from the start), where, how big and how long."""

    submit_s: float
    batch: int
    pool: str
    nodes: int
    runtime_s: float
    labels: tuple[str, ...]
    name: str


def soak_workload(config: SoakConfig) -> list[SoakJob]:
    """Batches of the InferenceX mix (one batch = one workflow run), spread over the soak.

    Batches are taken in the mix's order from a seeded offset until their node-seconds reach
    `offered_load` times the fleet's capacity over `sim_s`; each lands at a uniform random time
    in the first 80 % of the soak, so the last jobs can still finish.
    """
    rng = random.Random(config.seed)
    trace = read_job_mix()
    batches: dict[float, list[Any]] = defaultdict(list)
    for job in trace.jobs:
        pool = (job.pool or "").removeprefix("cluster:")
        if pool in config.pools and job.nodes <= config.pools[pool]:
            batches[job.submit_s].append(job)
    ordered = [batches[key] for key in sorted(batches)]
    start = rng.randrange(len(ordered))
    target = config.offered_load * sum(config.pools.values()) * config.sim_s
    work = 0.0
    jobs: list[SoakJob] = []
    for index in range(len(ordered)):
        if work >= target:
            break
        batch = ordered[(start + index) % len(ordered)]
        submit = rng.uniform(0, 0.8 * config.sim_s) if index else 0.0
        for job in batch:
            runtime = round(job.runtime_s * config.runtime_scale, 1)
            work += job.nodes * runtime
            token = f"s{len(jobs) + 1}"
            score = job.score if job.score is not None else Decimal("1.000")
            pool = (job.pool or "").removeprefix("cluster:")
            labels = (
                "self-hosted",
                f"cluster:{pool}",
                f"{NODES_PREFIX}{job.nodes}",
                JobLabel(score, token).render(),
                f"{ATTEMPT_PREFIX}1",
            )
            jobs.append(SoakJob(submit, index, pool, job.nodes, runtime, labels, job.name))
    return sorted(jobs, key=lambda j: (j.submit_s, j.batch))


# ---- the invariants ------------------------------------------------------------------------------


class Violation(BaseModel):
    """One broken invariant, with what the checker saw."""

    invariant: str
    at_s: float  # virtual seconds from the soak's start
    detail: str


@dataclass
class _Stray:
    first_seen: float
    due: float  # virtual time from which a tick must remove it
    why: str
    reported: bool = False


@dataclass
class TickEnd:
    """A finished tick as its controller reported it."""

    controller: str
    started: float
    ended: float
    clean: bool  # no decision of the tick failed after its retries


class Checker:
    """The invariants, read from the emulator's state after every tick (never over HTTP)."""

    def __init__(self, state: EmulatorState, config: SoakConfig, clock: VirtualClock) -> None:
        self.state = state
        self.config = config
        self.clock = clock
        self.start = clock.now()
        self.checks = 0
        self.counts: Counter[str] = Counter()
        self.evidence: list[Violation] = []
        self.duplicate_leases: set[int] = set()
        self._strays: dict[tuple[int, str], _Stray] = {}
        self._clean_ticks: list[float] = []  # start times of ticks that ended cleanly
        with state.lock:
            self._unmanaged = {r.id: self._unmanaged_of(r.labels) for r in state.runners.values()}
        self._completed_seen: dict[int, float] = {}
        self._seen: set[tuple[str, object]] = set()

    @staticmethod
    def _unmanaged_of(labels: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return sorted((name, kind) for name, kind in labels if not is_managed(name))

    def _violate(self, invariant: str, detail: str, subject: object = None) -> None:
        """Count a violation once per (invariant, subject): a state that stays broken across
        checks is one violation, seen again."""
        key = (invariant, detail if subject is None else subject)
        if key in self._seen:
            return
        self._seen.add(key)
        self.counts[invariant] += 1
        if len(self.evidence) < EVIDENCE_KEPT:
            at = round(self.clock.now() - self.start, 1)
            self.evidence.append(Violation(invariant=invariant, at_s=at, detail=detail))

    def _ticks_since(self, virtual: float) -> int:
        return sum(1 for started in self._clean_ticks if started > virtual)

    def after_tick(self, tick: TickEnd | None) -> None:
        """Check every invariant now; `tick` (None for a final check) counts towards deadlines."""
        if tick is not None and tick.clean:
            self._clean_ticks.append(tick.started)
        with self.state.lock:
            self._check()
        self.checks += 1

    def _check(self) -> None:
        now = self.clock.now()
        runners = self.state.runners
        jobs = self.state.jobs
        gate_of = {
            job.id: frozenset(fold(label) for label in job.labels if is_anchor_label(label))
            for job in jobs.values()
        }
        # leases rebuilt from labels, independently of admission/model.py
        holders: dict[str, list[int]] = defaultdict(list)
        parsed: dict[str, LeaseLabel] = {}
        malformed: set[tuple[int, str]] = set()
        for runner in runners.values():
            for name, _ in runner.labels:
                if is_lease(name):
                    label = fold(name)
                    try:
                        parsed[label] = LeaseLabel.parse(label)
                    except LabelError:
                        malformed.add((runner.id, label))
                        self._note_stray(runner.id, label, now, now, "malformed lease label")
                        continue
                    holders[label].append(runner.id)

        def job_labels(runner_id: int) -> frozenset[str]:
            return frozenset(fold(n) for n, _ in runners[runner_id].labels if is_anchor_label(n))

        anchors: dict[str, int] = {}
        for label, ids in holders.items():
            with_jobs = sorted(rid for rid in ids if job_labels(rid))
            if with_jobs:
                anchors[label] = with_jobs[0]

        def committed(label: str) -> bool:
            """Its job runs on one of its runners, or its anchor carries exactly the job's gate
            labels (GitHub may dispatch it). A running job needs its gate labels no more: a
            stale removal of a shared `ci-attempt-1` off its anchor is harmless."""
            lease = parsed[label]
            job = jobs.get(lease.job_id)
            if job is not None and job.status == "in_progress" and job.runner_id in holders[label]:
                return True
            anchor = anchors.get(label)
            return anchor is not None and job_labels(anchor) == gate_of.get(lease.job_id)

        present: set[tuple[int, str]] = set(malformed)
        # 1. the unmanaged labels of every runner are exactly what they were
        for runner in runners.values():
            if self._unmanaged_of(runner.labels) != self._unmanaged.get(runner.id):
                self._violate(
                    "unmanaged-label-touched",
                    f"runner {runner.id} unmanaged labels {self._unmanaged_of(runner.labels)} "
                    f"were {self._unmanaged.get(runner.id)}",
                )
                self._unmanaged[runner.id] = self._unmanaged_of(runner.labels)

        # 2. no runner in the committed leases of two jobs; a second committed lease label of
        #    the same job (a killed or raced controller's copy) is a stray, not a second lease.
        #    Twins share their anchor, so a twin on other runners counts as committed too; the
        #    job's own lease is the one it runs on, else a whole one, else the older.
        def primacy(label: str) -> tuple[bool, bool, int, str]:
            job = jobs.get(parsed[label].job_id)
            runs_here = job is not None and job.status == "in_progress"
            runs_here = runs_here and job is not None and job.runner_id in holders[label]
            short = job is not None and len(holders[label]) < _nodes_of(job)
            return (not runs_here, short, parsed[label].created_at, label)

        twins: dict[int, list[str]] = defaultdict(list)
        for label in holders:
            if committed(label):
                twins[parsed[label].job_id].append(label)
        own = {min(labels, key=primacy) for labels in twins.values()}
        duplicates: set[tuple[int, str]] = set()
        for runner in runners.values():
            for label in holders:
                if runner.id in holders[label] and committed(label) and label not in own:
                    duplicates.add((runner.id, label))
            mine = sorted(
                (parsed[label].created_at, label) for label in own if runner.id in holders[label]
            )
            by_job: dict[int, list[str]] = defaultdict(list)
            for _, label in mine:
                by_job[parsed[label].job_id].append(label)
            if len(by_job) > 1:
                self._violate(
                    "runner-in-two-leases",
                    f"runner {runner.id} holds committed leases of jobs {dict(by_job)}",
                    subject=(runner.id, tuple(sorted(by_job))),
                )
            for labels in by_job.values():
                duplicates.update((runner.id, label) for label in labels[1:])
        # 3. capacity: each running managed job holds its whole lease in its pool, and no pool
        #    runs more nodes than it has online runners
        per_pool: Counter[str] = Counter()
        online: Counter[str] = Counter()
        for runner in runners.values():
            pool = _pool_of(runner.labels)
            if pool and runner.status == "online":
                online[pool] += 1
        jobs_with_lease: dict[int, list[str]] = defaultdict(list)
        for label, lease in parsed.items():
            if label in holders and committed(label):
                jobs_with_lease[lease.job_id].append(label)
        for job_id, labels in jobs_with_lease.items():
            if len(labels) > 1:
                self.duplicate_leases.add(job_id)
        for job in jobs.values():
            if job.status != "in_progress" or job.runner_id is None:
                continue
            nodes = _nodes_of(job)
            pool = _pool_of([(label, "") for label in job.labels])
            per_pool[pool or "-"] += nodes
            anchor_leases = [
                label
                for label in holders
                if job.runner_id in holders[label] and parsed[label].job_id == job.id
            ]
            enough = [
                label
                for label in anchor_leases
                if len(holders[label]) >= nodes
                and all(_pool_of(runners[rid].labels) == pool for rid in holders[label])
            ]
            if not enough:
                self._violate(
                    "capacity",
                    f"job {job.id} runs on runner {job.runner_id} with nodes:{nodes} but its "
                    f"leases there are {[(lb, holders[lb]) for lb in anchor_leases]}",
                    subject=job.id,
                )
        for pool, used in per_pool.items():
            if used > online.get(pool, 0):
                self._violate(
                    "capacity",
                    f"pool {pool} runs {used} nodes on {online.get(pool, 0)} online",
                    subject=pool,
                )
        # 4. strays: managed labels no lease explains must go within one tick of being due
        for label, ids in holders.items():
            lease = parsed[label]
            leased = jobs.get(lease.job_id)
            if leased is not None and leased.status == "completed":
                continue  # rule 5 owns it
            if committed(label):
                for rid in ids:
                    if (rid, label) in duplicates:
                        present.add((rid, label))
                        self._note_stray(rid, label, now, now, "a second lease of the same job")
                continue
            due = lease.created_at + self.config.orphan_grace_s + 1
            why = "lease without a complete anchor"
            if label in anchors:
                why = f"anchor {anchors[label]} lacks gate labels of job {lease.job_id}"
            for rid in ids:
                present.add((rid, label))
                self._note_stray(rid, label, now, due, why)
        for runner in runners.values():
            gates = job_labels(runner.id)
            if not gates:
                continue
            anchoring = [label for label, rid in anchors.items() if rid == runner.id]
            if anchoring or runner.busy:
                continue
            for label in gates:
                present.add((runner.id, label))
                self._note_stray(
                    runner.id, label, now, now, "job labels on a runner that anchors no lease"
                )
        for key in [key for key in self._strays if key not in present]:
            del self._strays[key]
        for (rid, label), stray in self._strays.items():
            if not stray.reported and self._ticks_since(max(stray.due, stray.first_seen)) >= 1:
                stray.reported = True
                self._violate(
                    "stray-label",
                    f"runner {rid} still carries {label} ({stray.why}), seen "
                    f"{now - stray.first_seen:.0f}s ago, after a full tick since it was due",
                )
        # 5. every completed job's lease is released within two ticks
        held_by_job: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for label, ids in holders.items():
            held_by_job[parsed[label].job_id].extend((rid, label) for rid in ids)
        for job in jobs.values():
            if job.status != "completed" or job.completed_at is None:
                continue
            if job.id not in held_by_job:
                self._completed_seen.pop(job.id, None)
                continue
            if self._ticks_since(job.completed_at) >= 2 and job.id not in self._completed_seen:
                self._completed_seen[job.id] = now
                self._violate(
                    "lease-not-released",
                    f"job {job.id} completed {now - job.completed_at:.0f}s ago; still leased: "
                    f"{held_by_job[job.id]}",
                )

    def _note_stray(self, rid: int, label: str, now: float, due: float, why: str) -> None:
        if (rid, label) not in self._strays:
            self._strays[(rid, label)] = _Stray(now, due, why)

    def leases_left(self) -> list[tuple[int, str]]:
        """Managed labels still on runners (for the end of a soak)."""
        with self.state.lock:
            return [
                (r.id, name)
                for r in self.state.runners.values()
                for name, _ in r.labels
                if is_managed(name)
            ]


def _pool_of(labels: list[tuple[str, str]]) -> str | None:
    pools = [fold(n).removeprefix("cluster:") for n, _ in labels if fold(n).startswith("cluster:")]
    return pools[0] if len(pools) == 1 else None


def _nodes_of(job: EmuJob) -> int:
    for label in job.labels:
        if fold(label).startswith(NODES_PREFIX):
            return int(label[len(NODES_PREFIX) :])
    return 1


# ---- the controllers -----------------------------------------------------------------------------


@dataclass
class _Controller:
    name: str
    period_s: float
    phase_s: float
    proc: subprocess.Popen[str] | None = None
    in_tick_since: float | None = None  # wall time of the running tick's start
    last_tick_wall_s: float = 0.5
    requests: int = 0
    retries: int = 0
    restarts: int = 0
    ticks: int = 0


def _controller_argv(
    url: str, controller: _Controller, config: SoakConfig, clock: VirtualClock
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "slurmgate.testbed.soak",
        "controller",
        "--url",
        url,
        "--name",
        controller.name,
        "--period-s",
        str(controller.period_s),
        "--phase-s",
        str(controller.phase_s),
        "--origin",
        repr(clock.origin),
        "--speed",
        str(clock.speed),
        "--client-timeout-s",
        str(config.client_timeout_s),
        "--orphan-grace-s",
        str(config.orphan_grace_s),
    ]


# ---- the report ----------------------------------------------------------------------------------


class SoakReport(BaseModel):
    """The numbers of one soak run."""

    config: SoakConfig
    wall_s: float
    sim_s: float
    ticks: int
    ticks_by_controller: dict[str, int]
    ticks_with_failures: int
    kills_mid_tick: int
    restarts: int
    jobs_queued: int
    jobs_started: int
    jobs_completed: int
    admissions: int  # jobs GitHub started (each one was admitted)
    admissions_reported: int  # admissions the controllers reported (killed ticks report none)
    rollbacks: int
    releases: int
    cleans: int
    faults_injected: dict[str, int]
    client_retries: int
    api_calls: int
    api_calls_per_admission: float | None
    checks: int
    violations: dict[str, int]
    violations_total: int
    evidence: list[Violation]
    duplicate_leases: int
    completed_leases_left: int
    tick_failures_sample: list[str]


# ---- the harness ---------------------------------------------------------------------------------


def run_soak(
    config: SoakConfig,
    *,
    log: Callable[[str], None] | None = None,
    log_dir: Path | None = None,
) -> SoakReport:
    """Run one soak to its end and return its numbers (the emulator lives in this process).

    With `log_dir`, each controller incarnation's tick log goes to a file there.
    """
    say = log or (lambda _msg: None)
    clock = VirtualClock(time.time(), config.speed)
    state = build_state(
        REPO, {}, token=TOKEN, clock=clock.now, quota_limit=10**9, fault_plan=config.fault_plan()
    )
    for pool, count in config.pools.items():
        width = max(2, len(str(count)))
        for i in range(1, count + 1):
            decoys = [DECOY_LABELS[(i + k) % len(DECOY_LABELS)] for k in range(2)]
            state.add_runner(f"{pool}-{i:0{width}d}", [f"cluster:{pool}", *decoys])
    workload = soak_workload(config)
    checker = Checker(state, config, clock)
    rng = random.Random(config.seed * 7919 + 1)
    server = BackgroundServer(state, tick_s=0.05).start()
    controllers = [
        _Controller("a", config.tick_periods_s[0], 0.0),
        _Controller("b", config.tick_periods_s[1], config.tick_periods_s[0] / 2),
    ]
    events: queue.Queue[tuple[_Controller, dict[str, Any]]] = queue.Queue()
    totals: Counter[str] = Counter()
    failures: list[str] = []
    kills = 0
    lock = threading.Lock()

    def start(controller: _Controller) -> None:
        stderr: IO[str] | int = subprocess.DEVNULL
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(log_dir / f"controller-{controller.name}.log", "a")  # noqa: SIM115
        proc = subprocess.Popen(
            _controller_argv(server.url, controller, config, clock),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        if not isinstance(stderr, int):
            stderr.close()  # the child holds its own copy
        controller.proc = proc
        controller.in_tick_since = None
        controller.requests = controller.retries = 0
        threading.Thread(target=_pump, args=(controller, proc.stdout, events), daemon=True).start()

    def feed() -> None:
        runs: dict[int, int] = {}
        for job in workload:
            time.sleep(clock.wall_until(checker.start + job.submit_s))
            if stop.is_set():
                return
            added = state.add_job(
                list(job.labels), job.runtime_s, name=job.name, run_id=runs.get(job.batch)
            )
            runs[job.batch] = added.run_id

    def kill_loop() -> None:
        if config.kill_mean_s is None:
            return
        nonlocal kills
        first = True
        while not stop.is_set():
            wait = rng.expovariate(1 / config.kill_mean_s)
            if first:  # until one lands, strike within a quarter of the soak, however short
                wait = min(wait, config.sim_s / 4)
            wait /= config.speed
            if stop.wait(wait):
                return
            victim = rng.choice(controllers)
            # wait for it to be inside a tick, then strike part-way through
            deadline = time.monotonic() + 10
            while victim.in_tick_since is None and time.monotonic() < deadline:
                if stop.wait(0.01):
                    return
            if stop.wait(rng.uniform(0, victim.last_tick_wall_s)):
                return
            with lock:
                proc = victim.proc
                if stop.is_set():
                    return
                if victim.in_tick_since is None or proc is None or proc.poll() is not None:
                    continue
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                victim.in_tick_since = None  # that tick never ends
                kills += 1
                first = False
            say(f"SIGKILL controller {victim.name} mid-tick")
            if stop.wait(rng.uniform(0.1, 0.5)):
                return
            with lock:
                victim.restarts += 1
                start(victim)

    stop = threading.Event()
    wall_started = time.monotonic()
    try:
        for controller in controllers:
            start(controller)
        threads = [threading.Thread(target=fn, daemon=True) for fn in (feed, kill_loop)]
        for thread in threads:
            thread.start()
        end_at = checker.start + config.sim_s
        drain_until: float | None = None
        draining: dict[str, int] = {}  # controller -> its ticks when the soak's time ran out
        while True:
            if clock.now() >= end_at:
                # Ticks in flight finish and count, so a short soak on a loaded machine, whose
                # first tick can outlast it, still reports its ticks; no new jobs, no new kills.
                if drain_until is None:
                    stop.set()
                    drain_until = time.monotonic() + DRAIN_WALL_S
                    draining = {c.name: c.ticks for c in controllers if c.in_tick_since}
                finished = all(
                    c.ticks > draining[c.name] or c.in_tick_since is None
                    for c in controllers
                    if c.name in draining
                )
                ticked = sum(c.ticks for c in controllers) > 0
                if (ticked and finished) or time.monotonic() > drain_until:
                    break
            try:
                controller, event = events.get(timeout=0.2)
            except queue.Empty:
                continue
            if event.get("pid") != (controller.proc.pid if controller.proc else None):
                continue  # a line from a killed incarnation
            if event["event"] == "start":
                controller.in_tick_since = time.monotonic()
                continue
            controller.in_tick_since = None
            controller.last_tick_wall_s = max(0.05, event["wall_s"])
            controller.ticks += 1
            for key in ("admitted", "rolled_back", "released", "cleaned"):
                totals[key] += int(event[key])
            totals["retries"] += int(event["retries"]) - controller.retries
            controller.retries = int(event["retries"])
            if event["failures"]:
                totals["ticks_with_failures"] += 1
                failures.extend(event["failures"][:2])
            checker.after_tick(
                TickEnd(controller.name, event["started"], event["ended"], not event["failures"])
            )
    finally:
        stop.set()
        with lock:
            for controller in controllers:
                if controller.proc is not None and controller.proc.poll() is None:
                    os.killpg(controller.proc.pid, signal.SIGKILL)
                    controller.proc.wait()
        checker.after_tick(None)
        with state.lock:
            stats = state.stats()
            jobs = list(state.jobs.values())
            completed_left = sum(
                1
                for job in jobs
                if job.status == "completed"
                and any(
                    is_lease(name) and f"-j{job.id}-" in fold(name)
                    for r in state.runners.values()
                    for name, _ in r.labels
                )
            )
        server.stop()
    # Every managed job GitHub started was admitted by some controller; the controllers' own
    # counts miss the admissions of ticks that were killed before they reported.
    admissions = sum(1 for job in jobs if job.started_at is not None)
    return SoakReport(
        config=config,
        wall_s=round(time.monotonic() - wall_started, 1),
        sim_s=round(clock.now() - checker.start, 1),
        ticks=sum(c.ticks for c in controllers),
        ticks_by_controller={c.name: c.ticks for c in controllers},
        ticks_with_failures=totals["ticks_with_failures"],
        kills_mid_tick=kills,
        restarts=sum(c.restarts for c in controllers),
        jobs_queued=len(jobs),
        jobs_started=sum(1 for job in jobs if job.started_at is not None),
        jobs_completed=sum(1 for job in jobs if job.status == "completed"),
        admissions=admissions,
        admissions_reported=totals["admitted"],
        rollbacks=totals["rolled_back"],
        releases=totals["released"],
        cleans=totals["cleaned"],
        faults_injected=stats["faults_injected"],
        client_retries=totals["retries"],
        api_calls=stats["total"],
        api_calls_per_admission=round(stats["total"] / admissions, 1) if admissions else None,
        checks=checker.checks,
        violations=dict(checker.counts),
        violations_total=sum(checker.counts.values()),
        evidence=checker.evidence,
        duplicate_leases=len(checker.duplicate_leases),
        completed_leases_left=completed_left,
        tick_failures_sample=failures[:EVIDENCE_KEPT],
    )


def _pump(
    controller: _Controller,
    stream: IO[str] | None,
    events: queue.Queue[tuple[_Controller, dict[str, Any]]],
) -> None:
    if stream is None:
        return
    for line in stream:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.put((controller, event))


# ---- the controller process ----------------------------------------------------------------------


async def controller_loop(args: argparse.Namespace) -> None:
    """Tick on a fixed virtual schedule forever, one JSON line at each tick's start and end."""
    clock = VirtualClock(args.origin, args.speed)
    settings = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        orphan_grace_s=args.orphan_grace_s,
    )
    client = GitHubClient(
        GitHubScope(repo=REPO, api_url=args.url),
        TOKEN,
        timeout_s=args.client_timeout_s,
        backoff_base_s=0.05,
        backoff_cap_s=0.4,
    )
    pid = os.getpid()

    def emit(event: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps({**event, "pid": pid}) + "\n")
        sys.stdout.flush()

    direct = direct_steps(client)
    # The anchor deadline runs on the virtual clock, the one the planner stamps leases with.
    deadline = AnchorDeadline(within_s=args.orphan_grace_s * 2 / 3, clock=clock.now)

    async def admit(planned: Admit, fleet_size: int, share: BatchShare) -> AdmitOutcome:
        try:
            outcome = await admit_lease(
                client, planned, fleet_size=fleet_size, deadline=deadline, verifier=share.verifier
            )
        except Exception as exc:
            log.info("admission %s failed: %s", planned.lease_label, one_line(exc))
            raise
        log.info(
            "admission %s on %s: %s undone=%s left=%s",
            planned.lease_label,
            planned.runner_ids,
            outcome.reason,
            outcome.undone,
            outcome.left_behind,
        )
        return outcome

    steps = replace(direct, admit=admit)
    log = logging.getLogger(f"soak.controller.{args.name}")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.name}[{os.getpid()}] %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    first = args.origin + args.phase_s
    async with client:
        while True:
            now = clock.now()
            k = max(0, math.ceil((now - first) / args.period_s))
            await asyncio.sleep(clock.wall_until(first + k * args.period_s))
            started, wall = clock.now(), time.monotonic()
            emit({"event": "start", "started": started})
            failures: list[str]
            try:
                report = await reconcile_tick(steps, settings, now=clock.now_dt, log=log)
                counts = report.counts()
                failures = list(report.failures)
            except Exception as exc:  # a failed read: the tick did nothing, the next one retries
                counts = {"admitted": 0, "rolled_back": 0, "released": 0, "cleaned": 0}
                failures = [f"read: {one_line(exc)}"]
            emit(
                {
                    "event": "end",
                    "started": started,
                    "ended": clock.now(),
                    "wall_s": time.monotonic() - wall,
                    "admitted": counts["admitted"],
                    "rolled_back": counts["rolled_back"],
                    "released": counts["released"],
                    "cleaned": counts["cleaned"],
                    "failures": [f[:300] for f in failures],
                    "requests": client.calls.total,
                    "retries": client.calls.retries,
                }
            )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m slurmgate.testbed.soak")
    sub = parser.add_subparsers(dest="command", required=True)
    ctl = sub.add_parser("controller", help="one controller: the reconcile tick on a schedule")
    ctl.add_argument("--url", required=True)
    ctl.add_argument("--name", required=True)
    ctl.add_argument("--period-s", type=float, required=True)
    ctl.add_argument("--phase-s", type=float, default=0.0)
    ctl.add_argument("--origin", type=float, required=True)
    ctl.add_argument("--speed", type=float, required=True)
    ctl.add_argument("--client-timeout-s", type=float, default=0.5)
    ctl.add_argument("--orphan-grace-s", type=float, default=30.0)
    run = sub.add_parser("run", help="one soak, its report as JSON on stdout")
    run.add_argument("--config", type=Path, help="a SoakConfig as JSON (default: the defaults)")
    run.add_argument("--log-dir", type=Path, help="keep each controller's tick log here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.command == "controller":
        with _quiet_exit():
            asyncio.run(controller_loop(args))
        return
    config = (
        SoakConfig.model_validate_json(args.config.read_text()) if args.config else SoakConfig()
    )
    report = run_soak(config, log=lambda msg: print(msg, file=sys.stderr), log_dir=args.log_dir)
    print(report.model_dump_json(indent=2))


class _quiet_exit:
    """SIGTERM and Ctrl-C end a controller without a traceback."""

    def __enter__(self) -> None:
        signal.signal(signal.SIGTERM, signal.default_int_handler)

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is KeyboardInterrupt


if __name__ == "__main__":
    main()
