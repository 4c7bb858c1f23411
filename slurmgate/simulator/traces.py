"""Job traces for the simulator: Standard Workload Format logs and the InferenceX job mix."""

from __future__ import annotations

import csv
import gzip
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from slurmgate.errors import InputError

DATA = Path(__file__).resolve().parent.parent / "data"
TRACES = DATA / "traces"
JOB_MIX = DATA / "inferencex-job-mix.csv"


class TraceError(InputError):
    """A trace file the simulator cannot read; the message names the file, line and fix."""


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace, in seconds from the start of the trace."""

    id: int
    submit_s: float
    runtime_s: float
    nodes: int
    limit_s: float  # the job's time limit, clamped to at least its runtime
    key: str  # history key for learned estimates
    pool: str | None = None  # the one pool it must run on; None = any pool that fits
    score: Decimal | None = None  # priority; None = arrival order (FCFS, as SWF logs have none)
    name: str = ""


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    jobs: tuple[TraceJob, ...]
    pools: dict[str, int] | None = None  # the pools the trace belongs on, if it says
    dropped: int = 0


# SWF fields (1-based in the standard): 1 id, 2 submit, 3 wait, 4 runtime, 5 allocated procs,
# 8 requested procs, 9 requested time, 12 user, 14 executable.
def read_swf(
    path: Path | str,
    *,
    size_scale: float = 1.0,
    arrival_scale: float = 1.0,
    limit: int | None = None,
) -> Trace:
    """Read an SWF log (gzipped or not).

    Jobs with size <= 0 or runtime <= 0 are dropped. Size is the allocated processor count (the
    requested one when absent), divided by `size_scale` and rounded up. The limit is the
    requested time, clamped to at least the actual runtime (36% of LANL jobs overran theirs);
    a job without a requested time gets its runtime. Submit times are shifted to start at 0 and
    multiplied by `arrival_scale` (0.8 = arrivals 25% denser).
    """
    path = Path(path)
    if size_scale <= 0 or arrival_scale <= 0:
        raise TraceError(
            f"--size-scale ({size_scale}) and --arrival-scale ({arrival_scale}) must be > 0"
        )
    jobs: list[TraceJob] = []
    dropped = 0
    first: float | None = None
    for lineno, fields in _swf_rows(path):
        try:
            job_id, submit, runtime = int(fields[0]), float(fields[1]), float(fields[3])
            procs = int(float(fields[4]))
            if procs <= 0:
                procs = int(float(fields[7]))
            requested = float(fields[8])
            user, executable = fields[11], fields[13]
        except (IndexError, ValueError):
            raise TraceError(
                f"{path.name}:{lineno}: not an SWF record (18 numeric fields expected); "
                "pass an SWF log or the job-mix CSV"
            ) from None
        if procs <= 0 or runtime <= 0:
            dropped += 1
            continue
        if first is None:
            first = submit
        nodes = max(1, math.ceil(procs / size_scale - 1e-9))
        limit_s = max(requested, runtime)
        jobs.append(
            TraceJob(
                id=job_id,
                submit_s=(submit - first) * arrival_scale,
                runtime_s=runtime,
                nodes=nodes,
                limit_s=limit_s,
                key=f"u{user}|x{executable}|n{nodes}|r{int(requested)}",
            )
        )
        if limit is not None and len(jobs) >= limit:
            break
    if not jobs:
        raise TraceError(f"{path.name}: no usable job (size > 0 and runtime > 0)")
    jobs.sort(key=lambda j: (j.submit_s, j.id))
    return Trace(path.name, tuple(jobs), None, dropped)


def _swf_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="ascii", errors="replace") as handle:
            for lineno, line in enumerate(handle, 1):
                line = line.strip()
                if line and not line.startswith(";"):
                    yield lineno, line.split()
    except FileNotFoundError:
        raise TraceError(
            f"trace {path} does not exist; give an SWF log or the job-mix CSV"
        ) from None
    except (OSError, EOFError) as exc:
        raise TraceError(f"trace {path} cannot be read ({exc})") from None


# ---- the InferenceX job mix --------------------------------------------------------------------

# Pool sizes: the snapshot's runner counts, except the GB200/GB300 NVL72 racks, which list 4 and 3
# runners but run rows of up to 18 nodes (18 trays): one token per tray, 18 each. H100 is 17
# after PR #2739 matched it to its Slurm partition.
MIX_POOLS: dict[str, int] = {
    "cluster:b200-dgxc": 10,
    "cluster:b200-nscale": 9,
    "cluster:b300-nv": 17,
    "cluster:gb200-nv": 18,
    "cluster:gb300-nv": 18,
    "cluster:h100-dgxc": 17,
    "cluster:h200-dgxc": 14,
    "cluster:mi355x-amds": 9,
}


@dataclass(frozen=True, slots=True)
class MixModel:
    """The stated arrival and duration model of the InferenceX job mix.

    Every night at `sweep_hour` a sweep queues, all at once, every row of a random
    `sweep_fraction` of the config keys. Through the working day (`day_start`..`day_end` h) pull
    requests arrive as a Poisson stream of `pr_per_hour`, each queueing every row of one random
    config key. Agentic rows run 3600 s (the dataset's `duration`); a fixed-seq-len row has a
    base duration drawn once per row, lognormal with median `fixed_median_s` and sigma
    `fixed_sigma`, and each run varies by +-`run_jitter`; all clamped to the row's timeout.
    """

    days: int = 14
    sweep_hour: float = 2.0
    sweep_fraction: float = 0.15
    day_start: float = 8.0
    day_end: float = 20.0
    pr_per_hour: float = 0.4
    fixed_median_s: float = 2700.0
    fixed_sigma: float = 0.5
    run_jitter: float = 0.15
    seed: int = 5


def _mix_score(row: dict[str, str], nodes: int, pull_request: bool) -> Decimal:
    """The seed's priority formula (docs/seed.md) on the facts the CSV carries."""
    score = Decimal("1.0")
    if row.get("disagg") == "True":
        score += Decimal("1.25")
    if row.get("scenario") == "agentic-coding":
        score += Decimal("1.0")
    if row.get("precision") == "fp4":
        score += Decimal("0.75")
    framework = row.get("framework", "")
    if framework.startswith(("sglang", "vllm", "dynamo-sglang", "dynamo-vllm")):
        score += Decimal("0.5")
    if pull_request:  # a PR run with its checklist done; nightly sweeps are schedule events
        score += Decimal("0.25")
    score -= Decimal("0.001") * (nodes - 1)
    return score.quantize(Decimal("0.001"))


def read_job_mix(path: Path | str = JOB_MIX, model: MixModel | None = None) -> Trace:
    """The InferenceX job mix replayed with `MixModel` (deterministic for a given seed)."""
    model = model or MixModel()
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except FileNotFoundError:
        raise TraceError(f"job mix {path} does not exist") from None
    need = {"row_id", "config_key", "total_nodes", "cluster_pool", "scenario", "job_timeout_min"}
    if not rows or not need <= set(rows[0]):
        raise TraceError(
            f"{path.name}: not the InferenceX job mix (columns {', '.join(sorted(need))} needed)"
        )
    rng = random.Random(model.seed)
    base: dict[str, float] = {}
    by_key: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        timeout_s = float(row["job_timeout_min"]) * 60
        if row["scenario"] == "agentic-coding":
            base[row["row_id"]] = min(3600.0, timeout_s)
        else:
            drawn = rng.lognormvariate(math.log(model.fixed_median_s), model.fixed_sigma)
            base[row["row_id"]] = min(max(drawn, 600.0), timeout_s)
        by_key.setdefault(row["config_key"], []).append(row)
    keys = sorted(by_key)
    arrivals: list[tuple[float, str, bool]] = []
    for day in range(model.days):
        t0 = day * 86400.0
        for key in keys:
            if rng.random() < model.sweep_fraction:
                arrivals.append((t0 + model.sweep_hour * 3600, key, False))
        t = t0 + model.day_start * 3600
        while True:
            t += rng.expovariate(model.pr_per_hour / 3600)
            if t >= t0 + model.day_end * 3600:
                break
            arrivals.append((t, rng.choice(keys), True))
    arrivals.sort()
    jobs: list[TraceJob] = []
    for submit, key, pull_request in arrivals:
        for row in by_key[key]:
            nodes = int(row["total_nodes"])
            timeout_s = float(row["job_timeout_min"]) * 60
            runtime = base[row["row_id"]]
            if row["scenario"] != "agentic-coding":
                runtime *= 1 + rng.uniform(-model.run_jitter, model.run_jitter)
            runtime = min(runtime, timeout_s)
            jobs.append(
                TraceJob(
                    id=len(jobs) + 1,
                    submit_s=submit,
                    runtime_s=round(runtime, 1),
                    nodes=nodes,
                    limit_s=timeout_s,
                    key=f"{row['row_id']}|n{nodes}",
                    pool=row["cluster_pool"],
                    score=_mix_score(row, nodes, pull_request),
                    name=row["row_id"],
                )
            )
    return Trace(path.name, tuple(jobs), dict(MIX_POOLS), 0)


def read_trace(
    path: Path | str,
    *,
    size_scale: float = 1.0,
    arrival_scale: float = 1.0,
    limit: int | None = None,
) -> Trace:
    """An SWF log (.swf or .swf.gz) or the job-mix CSV (.csv), by file name."""
    path = Path(path)
    if path.suffix == ".csv":
        trace = read_job_mix(path)
        if arrival_scale != 1.0 or size_scale != 1.0:
            jobs = tuple(
                TraceJob(
                    j.id,
                    j.submit_s * arrival_scale,
                    j.runtime_s,
                    max(1, math.ceil(j.nodes / size_scale - 1e-9)),
                    j.limit_s,
                    j.key,
                    j.pool,
                    j.score,
                    j.name,
                )
                for j in trace.jobs
            )
            trace = Trace(trace.name, jobs, trace.pools, trace.dropped)
        if limit is not None:
            trace = Trace(trace.name, trace.jobs[:limit], trace.pools, trace.dropped)
        return trace
    return read_swf(path, size_scale=size_scale, arrival_scale=arrival_scale, limit=limit)


def offered_load(jobs: Iterable[TraceJob], capacity: int) -> float:
    jobs = list(jobs)
    span = max(j.submit_s for j in jobs) - min(j.submit_s for j in jobs)
    work = sum(j.nodes * j.runtime_s for j in jobs)
    return work / (capacity * span) if span > 0 else math.inf
