"""Every admission policy on every replay scenario, side by side in one run.

Replays real job logs (KTH SP2, LANL CM-5) and the InferenceX job mix through the planner's
policies and writes `benchmarks/results/policies.{json,md}` plus PNG charts: the wait CDF per
policy, the wide-job wait over time, and a Gantt chart of one pool's busiest day. It also times
the fast replay driver against replaying through `plan()` on label-encoded runners (a ratio).

    .venv/bin/python benchmarks/bench_policies.py            # all scenarios (~25 min on 1 core)
    .venv/bin/python benchmarks/bench_policies.py --quick    # KTH on 100 nodes only
    .venv/bin/python benchmarks/bench_policies.py --scenarios kth100,lanl16  # some scenarios
    .venv/bin/python benchmarks/bench_policies.py --scenarios lanl16x0.8 --merge  # add to saved
    .venv/bin/python benchmarks/bench_policies.py --smoke --results-dir /tmp/p  # seconds
    .venv/bin/python benchmarks/bench_policies.py --jobs 2  # scenarios in 2 processes

`--smoke` replays the first SMOKE_JOBS jobs of every scenario (and a shorter prefix for the
driver ratio) and writes the same files, marked as a smoke run, to `--results-dir`, with the
charts of the two scenarios that have a Gantt day only (an SWF log and the job mix: each chart
costs a second or two, and the other eight draw the same code on other numbers). `--merge`
keeps the saved rows of the scenarios not replayed now, so a full run can be made in parts.

The targets table is a split: methods and constants are chosen on the KTH scenarios only
(`TUNING`); LANL/16, LANL/32 and the InferenceX mix, at their own load and heavier, are held
out and only reported. The default
row is built from `AdmissionSettings()` (what the controller runs), and greedy and classic EASY,
the two arms it is judged against, are replayed in the same run.

The reference numbers are `benchmarks/reference/sim-results.md` (an independent simulator);
they are copied below.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from options import SMOKE_NOTE, add_output_flags

from slurmgate.admission.policies import ReservationBackfill
from slurmgate.simulator.candidates import Predicted, TimeoutBound
from slurmgate.simulator.engine import (
    Result,
    controller_settings,
    sim_settings,
    simulate,
    simulate_via_plan,
)
from slurmgate.simulator.plots import gantt, wait_cdf, wide_waits
from slurmgate.simulator.traces import JOB_MIX, TRACES, Trace, read_trace

REPO = Path(__file__).resolve().parent.parent

SMOKE_JOBS = 150  # jobs per scenario in a smoke run
SMOKE_DRIVER_JOBS = 100  # jobs of the driver-ratio prefix in a smoke run
GANTT = ("kth100", "inferencex")  # scenarios with a Gantt day; a smoke run charts these only
KTH = TRACES / "KTH-SP2-1996-2.1-cln.swf.gz"
LANL = TRACES / "LANL-CM5-1994-4.1-cln.swf.gz"


@dataclass(frozen=True)
class Variant:
    label: str
    policy: str
    estimates: str = "timeout"
    knobs: dict[str, Any] = field(default_factory=dict)
    controller: bool = False  # start from the controller's defaults, not classic immediate EASY
    only: tuple[str, ...] | None = None  # replayed on these scenarios only (None: every one)
    candidate: type[ReservationBackfill] | None = None  # a simulator-only reservation method


# what the controller runs with no settings: read from AdmissionSettings, not repeated here
DEFAULTS = controller_settings()


def _method(knobs: dict[str, Any], candidate: type[ReservationBackfill] | None) -> str:
    settings = controller_settings(**knobs)
    estimates = settings.estimates
    if estimates == "learned" and settings.estimate_quantile != 0.8:
        estimates += f" q{settings.estimate_quantile:g}"
    after = settings.reserve_after_s
    trigger = f"{after / 3600:g}h" if after else "at once"
    planned = {None: "", Predicted: " on predictions", TimeoutBound: " timeout-bound"}
    wide = "" if settings.wide_fraction is None else f" wide>{settings.wide_fraction:g}"
    return f"{settings.policy}/{estimates}/{trigger}{wide}{planned[candidate]}"


# the scenarios with a reference row, and the tuning ones: the baselines and ablations that
# only explain (fcfs, conservative) are replayed there, not on every heavier held-out replay
EXPLAIN = ("kth100", "kth100x0.8", "kth-pools", "lanl32")
TUNING = ("kth100", "kth100x0.8", "kth100x0.75", "kth-pools")
# candidates rejected on the tuning scenarios: replayed there only
REJECTED = TUNING
LEARNED = {"policy": "easy", "estimates": "learned", "wide_fraction": None}
TIMEOUT_1H = {"policy": "easy", "estimates": "timeout", "reserve_after_s": 3600.0}
LEARNED_1H = {**LEARNED, "reserve_after_s": 3600.0, "estimate_quantile": 0.8}
CANDIDATE_SPECS: tuple[
    tuple[dict[str, Any], type[ReservationBackfill] | None, tuple[str, ...] | None], ...
] = (
    # planned on timeouts, a backfill taken at its prediction (the planner's ReservationBackfill)
    ({**LEARNED, "reserve_after_s": 0.0, "estimate_quantile": 0.8}, None, REJECTED),
    ({**LEARNED, "reserve_after_s": 0.0, "estimate_quantile": 0.95}, None, REJECTED),
    ({**LEARNED, "reserve_after_s": 0.0, "estimate_quantile": 1.0}, None, REJECTED),
    ({**LEARNED, "reserve_after_s": 3600.0, "estimate_quantile": 0.8}, None, REJECTED),
    ({**LEARNED, "reserve_after_s": 18000.0, "estimate_quantile": 0.8}, None, REJECTED),
    # the default before this one: the 1 h trigger for every job, on timeouts
    ({**TIMEOUT_1H, "wide_fraction": None}, None, None),
    # the 1 h trigger for wide jobs only (> 0.25 of the largest pool), on timeouts
    ({**TIMEOUT_1H, "wide_fraction": 0.25}, None, REJECTED),
    # learned estimates with the wide-job rules: the fraction chosen among these on KTH
    ({**LEARNED, "reserve_after_s": 0.0, "wide_fraction": 0.25}, None, REJECTED),
    ({**LEARNED_1H, "wide_fraction": 0.1}, None, REJECTED),
    ({**LEARNED_1H, "wide_fraction": 0.25}, None, None),
    ({**LEARNED_1H, "wide_fraction": 0.35}, None, REJECTED),
    ({**LEARNED_1H, "wide_fraction": 0.5}, None, REJECTED),
    # simulator candidates: planned on predictions
    ({**LEARNED, "reserve_after_s": 0.0, "estimate_quantile": 0.8}, TimeoutBound, REJECTED),
    ({**LEARNED, "reserve_after_s": 0.0, "estimate_quantile": 0.8}, Predicted, EXPLAIN),
    # the default before reservations were planned on timeouts, on every scenario
    ({**LEARNED, "reserve_after_s": 18000.0, "estimate_quantile": 0.8}, Predicted, None),
)


def _candidates() -> tuple[Variant, ...]:
    """The candidates on top of the controller's settings; the one whose settings are the
    controller's own defaults (and no simulator candidate) is labelled the default."""
    out = []
    for knobs, candidate, only in CANDIDATE_SPECS:
        label = _method(knobs, candidate)
        if candidate is None and controller_settings(**knobs) == DEFAULTS:
            label = f"default: {label}"
        elif candidate is Predicted and knobs.get("reserve_after_s"):
            label = f"before: {label}"
        out.append(
            Variant(label, "easy", knobs["estimates"], knobs, True, only=only, candidate=candidate)
        )
    if not any(v.label.startswith("default: ") for v in out):
        out.append(
            Variant(
                f"default: {_method({}, None)}",
                DEFAULTS.policy,
                DEFAULTS.estimates,
                controller=True,
            )
        )
    return tuple(out)


VARIANTS = (
    Variant("fcfs", "fcfs", only=EXPLAIN),
    Variant("greedy (seed)", "greedy"),
    Variant("easy/timeout", "easy"),
    Variant("conservative/timeout", "conservative", only=EXPLAIN),
    *_candidates(),
)
DEFAULT = next(v for v in VARIANTS if v.label.startswith("default: "))
# the methods held to the targets: the default and every candidate
CANDIDATES = tuple(v for v in VARIANTS if v.controller)


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    trace: Path
    pools: dict[str, int]
    wide_frac: float
    bound: bool = False
    read: dict[str, Any] = field(default_factory=dict)
    jobs: int | None = None  # replay only the trace's first `jobs` jobs


HEAVY_JOBS = 30_000
SCENARIOS = (
    Scenario("kth100", "KTH on 100 nodes", KTH, {"cluster:p0": 100}, 0.25),
    Scenario(
        "kth100x0.8",
        "KTH, arrivals x0.8",
        KTH,
        {"cluster:p0": 100},
        0.25,
        read={"arrival_scale": 0.8},
    ),
    Scenario(
        "kth100x0.75",
        "KTH, arrivals x0.75",
        KTH,
        {"cluster:p0": 100},
        0.25,
        read={"arrival_scale": 0.75},
    ),
    Scenario(
        "kth-pools",
        "KTH on pools 32,32,16,16,4",
        KTH,
        {f"cluster:p{i}": n for i, n in enumerate((32, 32, 16, 16, 4))},
        0.5,
    ),
    Scenario(
        "lanl32",
        "LANL/32 on one 32-node pool",
        LANL,
        {"cluster:p0": 32},
        0.25,
        read={"size_scale": 32},
    ),
    Scenario(
        "lanl16",
        "LANL/16 on pools 32,16,8,4,4",
        LANL,
        {f"cluster:p{i}": n for i, n in enumerate((32, 16, 8, 4, 4))},
        0.5,
        read={"size_scale": 16},
    ),
    # the first HEAVY_JOBS jobs only: a whole LANL trace at x0.8 takes ~2 min per replay (its
    # queue stays long), 6 replays would not fit a 10-minute run; the prefix offers 0.94
    Scenario(
        "lanl32x0.8",
        f"LANL/32, arrivals x0.8, first {HEAVY_JOBS:,} jobs",
        LANL,
        {"cluster:p0": 32},
        0.25,
        read={"size_scale": 32, "arrival_scale": 0.8},
        jobs=HEAVY_JOBS,
    ),
    Scenario(
        "lanl16x0.8",
        f"LANL/16 on pools 32,16,8,4,4, arrivals x0.8, first {HEAVY_JOBS:,} jobs",
        LANL,
        {f"cluster:p{i}": n for i, n in enumerate((32, 16, 8, 4, 4))},
        0.5,
        read={"size_scale": 16, "arrival_scale": 0.8},
        jobs=HEAVY_JOBS,
    ),
    Scenario("inferencex", "InferenceX mix on its pools", JOB_MIX, {}, 0.5, bound=True),
    Scenario(
        "inferencex-x0.7",
        "InferenceX mix, arrivals x0.7",
        JOB_MIX,
        {},
        0.5,
        bound=True,
        read={"arrival_scale": 0.7},
    ),
)
# The split: methods and constants are chosen on the KTH scenarios only; the rest is held out
# and only reported. KTH x0.7 offers a load of 1.0 (no steady state), so x0.75 (0.93) is the
# heaviest KTH scenario; LANL x0.8 offers 0.93; the InferenceX mix x0.7 offers 0.8 on its
# GB200/GB300 pools (x0.5 would offer 1.1 there).
HELD_OUT = tuple(s.key for s in SCENARIOS if s.key not in TUNING)
WIDE_TOLERANCE = 1.05  # wide max within 5% of EASY's: EASY itself moves that much on tie rules

# benchmarks/reference/sim-results.md: mean wait h, p95 wait h, wide max wait h, mean bsld
REFERENCE: dict[tuple[str, str], tuple[float, float, float, float]] = {
    ("kth100", "fcfs"): (108.36, 239.59, 281.7, 7514.4),
    ("kth100", "greedy (seed)"): (1.60, 7.06, 478.7, 71.4),
    ("kth100", "easy/timeout"): (1.91, 10.42, 72.8, 90.4),
    ("kth100", "conservative/timeout"): (2.24, 11.62, 69.4, 101.8),
    ("kth100x0.8", "fcfs"): (825.31, 1179.48, 1202.3, 53608.8),
    ("kth100x0.8", "greedy (seed)"): (7.66, 22.07, 3871.6, 340.0),
    ("kth100x0.8", "easy/timeout"): (6.36, 31.34, 132.8, 276.7),
    ("kth100x0.8", "conservative/timeout"): (8.49, 36.79, 147.8, 290.4),
    ("kth-pools", "fcfs"): (9.85, 49.48, 81.2, 601.1),
    ("kth-pools", "greedy (seed)"): (0.47, 2.14, 119.0, 20.4),
    ("kth-pools", "easy/timeout"): (0.45, 2.64, 56.5, 20.6),
    ("kth-pools", "conservative/timeout"): (0.45, 2.81, 56.5, 20.8),
    ("lanl32", "fcfs"): (22.07, 101.04, 130.6, 1279.6),
    ("lanl32", "greedy (seed)"): (1.75, 8.64, 1126.0, 60.6),
    ("lanl32", "easy/timeout"): (2.37, 12.42, 46.0, 75.2),
    ("lanl32", "conservative/timeout"): (2.48, 12.85, 47.0, 74.3),
}


def run(scenario: Scenario, trace: Trace, variant: Variant) -> tuple[Result, dict[str, Any], float]:
    pools = scenario.pools or dict(trace.pools or {})
    settings = (controller_settings if variant.controller else sim_settings)(**variant.knobs)
    policy: str | ReservationBackfill = variant.policy
    if variant.candidate is not None:
        policy = variant.candidate(variant.policy, 1, settings.reserve_after_s)
    started = time.perf_counter()
    result = simulate(
        trace,
        pools,
        policy,
        estimates=variant.estimates,
        bound=scenario.bound,
        settings=settings,
    )
    elapsed = time.perf_counter() - started
    metrics = result.metrics(scenario.wide_frac)
    metrics["seconds"] = round(elapsed, 2)
    return result, metrics, elapsed


def driver_ratio(limit: int = 1500) -> dict[str, Any]:
    """Fast driver vs plan() on label-encoded runners, same KTH prefix, same schedule."""
    trace = read_trace(KTH, limit=limit)
    pools = {"cluster:p0": 100}
    out: dict[str, Any] = {"jobs": len(trace.jobs)}
    for policy in ("greedy", "easy"):
        t0 = time.perf_counter()
        fast = simulate(trace, pools, policy)
        t1 = time.perf_counter()
        slow = simulate_via_plan(trace, pools, policy)
        t2 = time.perf_counter()
        same = sorted((r.job_id, r.start_s) for r in fast.runs) == sorted(
            (r.job_id, r.start_s) for r in slow.runs
        )
        out[policy] = {
            "fast_s": round(t1 - t0, 3),
            "via_plan_s": round(t2 - t1, 3),
            "ratio": round((t2 - t1) / (t1 - t0), 1),
            "plans": slow.plans,
            "same_schedule": same,
        }
    return out


NOTES = """
## Notes

- **Cross-check.** fcfs and greedy reproduce the reference on every scenario to its printed
  precision. conservative here is bounded (`reservation_depth` 32 per pool, like Slurm's
  `bf_max_job_test`); with an unbounded depth it reproduces the reference exactly on KTH x0.8
  (8.49 / 36.79 / 147.8 / 290.4). easy matches a textbook Lifka EASY (shadow time and extra
  runners) job for job on the whole KTH x0.8 trace (checked by the independent implementation in
  `tests/simulator/test_replay.py`), within 1% of the reference on KTH at native load, and 2-9%
  off on KTH x0.8, the five pools and LANL/32. EASY is sensitive to tie rules at equal
  timestamps (KTH's requested times are round numbers): on KTH x0.8, counting only the first
  lease that ends at the shadow time gives a mean wait of 6.07 h, a strict "ends before the
  shadow" gives 6.49 h, ours (every lease ending then counts, ending exactly at the shadow is
  allowed) 6.21 h, the reference 6.36 h. Across several pools the reference does not say which
  pool a reservation takes; ours takes the pool with the earliest start, one reservation per pool.
- **Target.** The default dominates classic EASY on every scenario: wide max <= 1.05 x
  easy/timeout's and mean wait <= its mean, both measured in the same run; mean bounded slowdown
  is shown beside them (greedy's mean too, for reference). Methods are chosen on the KTH
  scenarios only; LANL and the InferenceX mix are replayed afterwards and only reported.
- **Default.** easy on learned estimates with the wide-job rules (`wide_fraction` 0.25): a job
  needing more than a quarter of its largest pool waits 1 h for a reservation (Slurm's
  `bf_min_age_reserve`), a narrower one is reserved at once, and a job starting beside a wide
  job's reservation is taken at its timeout, beside a narrow one at its learned estimate; the row
  is built from `AdmissionSettings()`. The rule, fixed before any held-out replay: the candidate
  that misses the target on the fewest KTH scenarios, then the smallest worst excess over a
  target (negative when every target is met). It is the only candidate that meets the target on
  all four KTH scenarios (worst mean x0.998 of EASY's, on x0.75); the 1 h trigger on timeouts
  (the default before) misses one (KTH x0.75's mean, x1.026), the 5 h learned default before it
  one (the five pools' mean, x1.036).
- **The wide-job rules (chosen on KTH).** Learned estimates beside every reservation lengthen
  the wide maximum under heavy load (below); a learned estimate beside a narrow reservation does
  not, because a narrow head that a too-short prediction pushes back is soon passed by its own
  backfill's end. Beside a wide reservation the kill bound keeps classic EASY's guarantee for
  the convoys. The fraction was chosen among 0.1, 0.25, 0.35 and 0.5 (wide max / mean of EASY's
  on kth100, x0.8, x0.75, the pools): 0.1 misses x0.8's and x0.75's mean (x1.008, x1.007), 0.35
  and 0.5 x0.8's wide max (x1.097, x1.057), 0.5 the pools' mean too (x1.011); without the 1 h
  trigger (reserved at once) 0.25 misses the pools' mean by 0.00004 %.
- **Held out, the default** (wide max / mean / bsld of EASY's): LANL/32 x0.952 / x0.945 /
  x0.930 and LANL/32 x0.8 x1.037 / x0.987 / x1.030 (met; the default before missed x0.8's mean
  by 4.0 %), the mix x1.000 / x0.989 / x0.992 (met), LANL/16 x1.000 / x1.030 / x1.026, LANL/16
  x0.8 x1.015 / x1.010 / x1.009 and the mix at x0.7 x0.997 / x1.006 / x1.006 (mean missed by
  3.0 %, 1.05 % and 0.59 %; the default before missed them by 2.6 %, 1.1 % and 0.59 %). The wide
  maximum is met everywhere. Why LANL/16 misses: its job sizes are powers of two (2-64 nodes)
  on pools of 32, 16, 8, 4 and 4, so most reservations fill most of a small pool, are wide by
  the pool they are made on, and take backfill at timeouts as EASY does, while the 1 h trigger
  still holds off reservations for the >8-node heads on the 32- and 16-node pools; against
  EASY the 2-4 node jobs wait +4,957 job-hours, the >8-node jobs +3,492, the 5-8 node jobs +798.
  On the mix nearly every job needs more than a quarter of its pool (18-node GB pools), so the
  rules give the default before's schedule exactly.
- **What the candidates showed (KTH only).** Reservations planned on timeouts with a backfill
  taken at its learned prediction (the planner's `learned` mode now) lowers the mean most (KTH
  x0.944, x0.8 x0.879, x0.75 x0.913 of EASY) but lengthens the wide maximum under heavy load:
  on KTH x0.75 it is set by a convoy of 80- and 94-node jobs submitted on days 121-124 that each
  wait 208-235 h under EASY, and each waits about 17 h longer (x1.070) because the extra
  backfill runs past the reservations it was sized to fit before. A higher quantile moves the
  miss to KTH x0.8 (q 0.95 x1.099, q 1.0 x1.086); the midpoint of prediction and timeout x1.072
  there; a 1 h or 5 h trigger on top of it misses both heavy KTH replays or kth100. Planned on
  predictions with the backfill checked for its timeout (`TimeoutBound`), the mean is above
  EASY's on KTH x0.8 (x1.022), x0.75 (x1.034) and the pools (x1.106). A shortest-first backfill
  order after the reservation (EASY-SJBF, prototyped outside the benchmark) missed kth100's
  wide max (x1.094) and the pools' mean (x1.014). A trigger on timeouts lowers EASY's mean at
  native load but raises it at heavy load (1 h x1.026, 30 min x1.027 on KTH x0.75); 2 h and 5 h
  miss KTH x0.8's wide max (x1.052, x1.090).
- **Heavier load.** KTH x0.75 (offered 0.93) tunes; LANL/32 and LANL/16 at arrivals x0.8 (the
  trace's first 30,000 jobs, offered 0.94) and the mix at x0.7 (0.8 on its GB200/GB300 pools)
  are held out. KTH x0.7 and the mix at x0.5 offer more than the capacity (1.0; 1.1 on the GB
  pools): the backlog only grows, so they are not replayed here.
- **The trigger for wide jobs only, on timeouts.** The 1 h trigger's excess on KTH x0.75 (mean
  x1.026 of EASY's) is carried by 5-25-node jobs (+14,950 job-hours against EASY) that 1-4-node jobs
  pass while they are young heads (-3,640 job-hours); wide jobs are nearly even (+1,195).
  The trigger for jobs needing more than f of their largest pool only (narrower ones reserved
  at once; `wide_fraction` on timeouts): f = 0.25 was best among 0.1, 0.25, 0.35 and 0.5 (wide
  max / mean of EASY's): kth100 x1.000 / x0.975, x0.8 x1.036 / x0.994, x0.75 x1.000 /
  x1.0016, the pools x0.842 / x0.997; it misses one KTH target (x0.75's mean, by 0.16%) where
  the 1 h trigger misses it by 2.6%.
  f = 0.1 keeps x0.75's x1.026; f = 0.35 and 0.5 miss x0.8's wide max (x1.156). Two ideas were
  rejected on KTH: a load-adaptive trigger (reserve at once while the queued jobs' timeout
  node-hours over their pools' nodes exceed H) keeps the 1 h trigger's mean on x0.75 for every H >=
  1 h (x1.026-x1.028) and is classic EASY there for H <= 0.75 h, because the trigger only acts while
  the oldest blocked job is under an hour old, when the queue holds little more than the last hour's
  arrivals; H = 0.5 h and 0.25 h miss the pools' mean (x1.010, x1.003). Deferring a reservation to 1
  h after submission (backfill may use the time before it) misses the pools' mean (x1.021). A
  smaller-first order among jobs of equal priority is a no-op on the SWF traces (their scores are
  arrival ranks, all distinct), so KTH cannot choose it.
- **Earlier candidates, removed from the product.** Under the earlier target (mean <= 1.10 x
  greedy's) the slowdown trigger (B = 1), min(5 h, 2 x the running leases' median estimate), the
  EASY++ order, wide jobs at once (f = 0.5) and the timeout-bounded backfill with the 5 h
  trigger were each chosen on KTH and rejected (runs aa07954 and 3c2d0ce); they are no longer
  settings, and only the timeout-bounded backfill and planning on predictions stay, as
  simulator candidates (`slurmgate/simulator/candidates.py`).
- **An age factor** in the priority (Slurm multifactor's) was not tried: in the SWF replays a
  job's score is its arrival rank, so the priority order already is the age order and an age
  weight changes nothing there; only the InferenceX mix has scores for it to act on.
- **InferenceX mix.** Stated model (`slurmgate/simulator/traces.py`, `MixModel`): 14 days; every
  night at 02:00 a sweep queues all rows of 15% of the config keys at once; PRs arrive 08-20 h
  as a Poisson stream of 0.4/h, each queueing all rows of one key; agentic rows run 3600 s,
  fixed-seq-len rows a per-row lognormal base (median 45 min, sigma 0.5) +-15% per run; GB200 /
  GB300 pools have 18 tokens (one per NVL72 tray; the snapshot's 4 and 3 runners cannot hold
  their 18-node rows). Its waits come from the nightly burst, not from starvation: every
  policy's wide maximum is the same 28.7 h.
"""


def target(
    scenario: str,
    variant: Variant,
    metrics: dict[str, Any],
    by_label: dict[str, tuple[Result, dict[str, Any]]],
) -> dict[str, Any]:
    """One method against the targets on one scenario: it dominates classic EASY, measured in
    the same run (greedy's mean beside it for reference)."""
    greedy = by_label["greedy (seed)"][1]
    easy = by_label["easy/timeout"][1]
    wide_ratio = metrics["wide_max_wait_h"] / max(easy["wide_max_wait_h"], 1e-9)
    mean_ratio = metrics["mean_wait_h"] / max(easy["mean_wait_h"], 1e-9)
    bsld_ratio = metrics["mean_bsld"] / max(easy["mean_bsld"], 1e-9)
    easy_at_bound = easy["utilization"] >= 0.99 * easy["utilization_bound"]
    util_ok = not easy_at_bound or metrics["utilization"] >= 0.99 * metrics["utilization_bound"]
    misses = []
    if wide_ratio > WIDE_TOLERANCE:
        misses.append(f"wide max +{(wide_ratio - 1) * 100:.1f}%")
    if mean_ratio > 1.0:
        misses.append(f"mean +{(mean_ratio - 1) * 100:.2f}%")
    if not util_ok:
        misses.append("utilization")
    return {
        "scenario": scenario,
        "split": "tuning" if scenario in TUNING else "held out",
        "method": variant.label,
        "wide_max": metrics["wide_max_wait_h"],
        "easy_wide_max": easy["wide_max_wait_h"],
        "wide_ratio": wide_ratio,
        "mean": metrics["mean_wait_h"],
        "easy_mean": easy["mean_wait_h"],
        "mean_ratio": mean_ratio,
        "bsld": metrics["mean_bsld"],
        "easy_bsld": easy["mean_bsld"],
        "bsld_ratio": bsld_ratio,
        "greedy_mean_ratio": metrics["mean_wait_h"] / max(greedy["mean_wait_h"], 1e-9),
        "util": metrics["utilization"],
        "easy_util": easy["utilization"],
        "met": "yes" if not misses else "no: " + ", ".join(misses),
    }


def fmt(value: float) -> str:
    return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"


def markdown(
    rows: list[dict[str, Any]],
    targets: list[dict[str, Any]],
    ratio: dict[str, Any],
    smoke: bool = False,
) -> str:
    lines = [
        "# Admission policies replayed on real traces",
        "",
        *([SMOKE_NOTE, ""] if smoke else []),
        "Written by `benchmarks/bench_policies.py` (every scenario x every policy; a full run "
        "may be made in parts with `--merge`, see the commit). "
        "Waits in hours; `ref` = the independent reference simulator "
        "(`benchmarks/reference/sim-results.md`): mean / p95 / wide max / bsld.",
        "",
        "| scenario | policy | jobs | util (bound) | makespan/LB | mean wait | median | p95 | max "
        "| mean bsld | wide mean | wide max | ref | replay s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["metrics"]
        ref = REFERENCE.get((row["scenario"], row["policy"]))
        ref_text = " / ".join(fmt(x) for x in ref) if ref else ""
        lines.append(
            f"| {row['scenario']} | {row['policy']} | {m['jobs']} (+{m['rejected']} rej.) "
            f"| {m['utilization']:.3f} ({m['utilization_bound']:.3f}) "
            f"| {m['makespan_over_bound']:.3f} | {fmt(m['mean_wait_h'])} "
            f"| {fmt(m['median_wait_h'])} | {fmt(m['p95_wait_h'])} | {fmt(m['max_wait_h'])} "
            f"| {fmt(m['mean_bsld'])} | {fmt(m['wide_mean_wait_h'])} "
            f"| {fmt(m['wide_max_wait_h'])} | {ref_text} | {m['seconds']} |"
        )
    lines += [
        "",
        "## The default and the trigger candidates against the targets",
        "",
        "Targets: the method dominates classic EASY (easy/timeout, measured in the same run): "
        f"wide max wait <= {WIDE_TOLERANCE:.2f} x EASY's (5% for its tie rules) and mean wait "
        "<= EASY's; utilization within 1% of the bound wherever EASY reaches it. Mean bounded "
        "slowdown (10 s) and the mean against greedy's are shown beside them. Split: every "
        "method and constant was chosen on the "
        f"tuning scenarios ({', '.join(TUNING)}, all KTH); the held-out scenarios were only "
        "replayed afterwards.",
        "",
        "| split | scenario | method | wide max: method / EASY | mean wait: method / EASY "
        "| mean bsld: method / EASY | mean / greedy's | util: method / EASY | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted(targets, key=lambda t: t["split"] != "tuning"):
        lines.append(
            f"| {t['split']} | {t['scenario']} | {t['method']} "
            f"| {fmt(t['wide_max'])} / {fmt(t['easy_wide_max'])} (x{t['wide_ratio']:.3f}) "
            f"| {fmt(t['mean'])} / {fmt(t['easy_mean'])} (x{t['mean_ratio']:.3f}) "
            f"| {fmt(t['bsld'])} / {fmt(t['easy_bsld'])} (x{t['bsld_ratio']:.3f}) "
            f"| x{t['greedy_mean_ratio']:.3f} | {t['util']:.3f} / {t['easy_util']:.3f} "
            f"| {t['met']} |"
        )
    lines += [
        "",
        f"## Replay drivers side by side (KTH, first {ratio['jobs']} jobs, 100 nodes)",
        "",
        "| policy | fast driver s | plan() on labels s | ratio | plans | same schedule |",
        "|---|---|---|---|---|---|",
    ]
    for policy in ("greedy", "easy"):
        r = ratio[policy]
        lines.append(
            f"| {policy} | {r['fast_s']} | {r['via_plan_s']} | x{r['ratio']} | {r['plans']} "
            f"| {r['same_schedule']} |"
        )
    lines += ["", *NOTES.strip("\n").split("\n")]
    return "\n".join(lines) + "\n"


def replay_scenario(
    scenario: Scenario, limit: int | None, out: Path, charts: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every variant on one scenario, its target rows and (unless `charts` is false) its
    charts."""
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    sizes = [n for n in (limit, scenario.jobs) if n is not None]
    trace = read_trace(scenario.trace, **scenario.read, limit=min(sizes) if sizes else None)
    print(f"== {scenario.title}: {len(trace.jobs)} jobs", flush=True)
    by_label: dict[str, tuple[Result, dict[str, Any]]] = {}
    for variant in VARIANTS:
        if variant.only is not None and scenario.key not in variant.only:
            continue
        result, metrics, elapsed = run(scenario, trace, variant)
        by_label[variant.label] = (result, metrics)
        rows.append({"scenario": scenario.key, "policy": variant.label, "metrics": metrics})
        print(
            f"  {variant.label:26} mean {metrics['mean_wait_h']:8.2f} h  p95 "
            f"{metrics['p95_wait_h']:8.2f} h  wide max {metrics['wide_max_wait_h']:8.1f} h  "
            f"util {metrics['utilization']:.3f}  ({elapsed:.1f} s)",
            flush=True,
        )
    for variant in CANDIDATES:
        if variant.label in by_label:
            targets.append(target(scenario.key, variant, by_label[variant.label][1], by_label))
    if not charts:
        return rows, targets
    wait_cdf(
        {label: [r.wait_s / 3600 for r in res.runs] for label, (res, _) in by_label.items()},
        out / f"policies-{scenario.key}-wait-cdf.png",
        f"{scenario.title}: wait CDF per policy",
    )
    wide_above = scenario.wide_frac * max((scenario.pools or trace.pools or {"": 1}).values())
    wide_waits(
        {
            label: [(r.submit_s / 86400, r.wait_s / 3600) for r in res.runs if r.nodes > wide_above]
            for label, (res, _) in by_label.items()
            if label != "fcfs"
        },
        out / f"policies-{scenario.key}-wide-waits.png",
        f"{scenario.title}: waits of wide jobs (> {wide_above:g} nodes)",
    )
    if scenario.key in GANTT:
        for label, tag in (("greedy (seed)", "greedy"), (DEFAULT.label, "default")):
            result = by_label[label][0]
            greedy_runs = by_label["greedy (seed)"][0].runs
            pool = max(result.pools, key=lambda p: (result.pools[p], p))
            from slurmgate.simulator.plots import busiest_day

            day = busiest_day(greedy_runs, pool)
            gantt(
                result.runs,
                out / f"policies-{scenario.key}-gantt-{tag}.png",
                pool=pool,
                start_s=day,
                wide_above=wide_above,
                title=f"{scenario.title}, {label}: {pool} over greedy's busiest day",
            )
    return rows, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="KTH on 100 nodes only")
    parser.add_argument(
        "--scenarios",
        help=f"comma-separated scenario keys to replay (of {', '.join(s.key for s in SCENARIOS)})",
    )
    add_output_flags(
        parser, f"the first {SMOKE_JOBS} jobs of every scenario, charts of {' and '.join(GANTT)}"
    )
    parser.add_argument(
        "--out", dest="results_dir", type=Path, default=argparse.SUPPRESS, help="= --results-dir"
    )
    parser.add_argument(
        "--render", action="store_true", help="rewrite policies.md from policies.json only"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="scenarios replayed in parallel processes"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the saved rows (policies.json) of the scenarios not replayed in this run",
    )
    args = parser.parse_args(argv)
    out: Path = args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        saved = json.loads((out / "policies.json").read_text())
        (out / "policies.md").write_text(
            markdown(saved["rows"], saved["targets"], saved["drivers"], saved.get("smoke", False))
        )
        return 0
    scenarios = SCENARIOS[:1] if args.quick else SCENARIOS
    if args.scenarios:
        wanted = {key.strip() for key in args.scenarios.split(",")}
        unknown = wanted - {s.key for s in SCENARIOS}
        if unknown:
            parser.error(f"--scenarios: unknown {', '.join(sorted(unknown))}")
        scenarios = tuple(s for s in SCENARIOS if s.key in wanted)
    limit = SMOKE_JOBS if args.smoke else None
    rows: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    # scenarios are independent replays: --jobs runs them in parallel processes, the longest
    # (LANL, heaviest load first) started first; results are kept in the scenarios' order
    longest_first = sorted(
        scenarios, key=lambda s: (s.trace != LANL, s.read.get("arrival_scale", 1))
    )
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            s.key: pool.submit(replay_scenario, s, limit, out, not args.smoke or s.key in GANTT)
            for s in longest_first
        }
        for scenario in scenarios:
            scenario_rows, scenario_targets = futures[scenario.key].result()
            rows += scenario_rows
            targets += scenario_targets
    ratio = driver_ratio(SMOKE_DRIVER_JOBS) if args.smoke else driver_ratio()
    print(
        f"== drivers on KTH[:{ratio['jobs']}]: plan() on labels is "
        f"x{ratio['greedy']['ratio']} (greedy) / x{ratio['easy']['ratio']} (easy) slower than the "
        f"fast driver; same schedule: {ratio['greedy']['same_schedule']}, "
        f"{ratio['easy']['same_schedule']}",
        flush=True,
    )
    for t in targets:
        print(
            f"  target {t['split']:8} {t['scenario']:11} {t['method']:30} wide "
            f"x{t['wide_ratio']:.3f}, mean x{t['mean_ratio']:.3f}, bsld x{t['bsld_ratio']:.3f} "
            f"of EASY: {t['met']}"
        )
    suffix = "-quick" if args.quick else ""
    if args.merge and (out / f"policies{suffix}.json").exists():
        earlier = json.loads((out / f"policies{suffix}.json").read_text())
        # the saved rows of scenarios that still exist and were not replayed now
        order = [s.key for s in SCENARIOS]
        kept = set(order) - {s.key for s in scenarios}
        rows = [r for r in earlier["rows"] if r["scenario"] in kept] + rows
        targets = [t for t in earlier["targets"] if t["scenario"] in kept] + targets
        rows.sort(key=lambda r: order.index(r["scenario"]))
        targets.sort(key=lambda t: order.index(t["scenario"]))
    saved = {"rows": rows, "targets": targets, "drivers": ratio, "smoke": args.smoke}
    (out / f"policies{suffix}.json").write_text(json.dumps(saved, indent=1, sort_keys=True))
    (out / f"policies{suffix}.md").write_text(markdown(rows, targets, ratio, args.smoke))
    print(f"wrote {out / f'policies{suffix}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
