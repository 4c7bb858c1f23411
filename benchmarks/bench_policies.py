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
driver ratio) and writes the same files, marked as a smoke run, to `--results-dir`. `--merge`
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

SMOKE_JOBS = 400  # jobs per scenario in a smoke run
SMOKE_DRIVER_JOBS = 200  # jobs of the driver-ratio prefix in a smoke run
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


# what the controller runs with no settings: read from AdmissionSettings, not repeated here
DEFAULTS = controller_settings()


def _trigger(settings: Any) -> str:
    if settings.reserve_slowdown is not None:
        trigger = f"slowdown {settings.reserve_slowdown:g}"
    elif settings.reserve_after_runtimes is not None:
        q = settings.reserve_runtime_quantile
        trigger = f"{settings.reserve_after_runtimes:g} x running p{q * 100:g}"
        if settings.reserve_after_s:
            trigger = f"min({settings.reserve_after_s / 3600:g}h, {trigger})"
    else:
        trigger = f"{settings.reserve_after_s / 3600:g}h"
    if settings.reserve_wide_frac is not None:
        trigger += f"/wide>{settings.reserve_wide_frac:g} at once"
    if settings.backfill_bound == "timeout":
        trigger += "/timeout-bound"
    return trigger + ("/sjf" if settings.backfill_order == "shortest" else "")


def _method(policy: str, estimates: str, knobs: dict[str, Any]) -> str:
    return f"{policy}/{estimates}/{_trigger(controller_settings(**knobs))}"


# the reservation trigger derived from each job's own length: reserve a blocked job once its
# wait reaches SLOWDOWN_B x its estimated runtime; B chosen on the KTH scenarios only
SLOWDOWN_B = 1.0
# the trigger derived from the running workload: reserve a blocked job once it waited
# RUNTIMES_K x the RUNTIMES_Q quantile of the running leases' estimates, or the default 5 h if
# that is shorter; chosen on the KTH scenarios only (see the notes)
RUNTIMES_K, RUNTIMES_Q = 2.0, 0.5
RUNTIMES = {"reserve_after_runtimes": RUNTIMES_K, "reserve_runtime_quantile": RUNTIMES_Q}
# wide jobs reserved at once: a blocked job needing more than WIDE_FRAC of its largest pool;
# chosen on the KTH scenarios only (see the notes)
WIDE_FRAC = 0.5
# the trigger every learned candidate starts from: 5 h, the default before reserve_wide_frac
AGE = {"reserve_after_s": 5 * 3600.0, "reserve_wide_frac": None}
# the scenarios with a reference row, and the tuning ones: the baselines and ablations that
# only explain (fcfs, conservative, learned estimates alone) are replayed there, not on every
# heavier held-out replay, which keeps a full run near 10 minutes
EXPLAIN = ("kth100", "kth100x0.8", "kth-pools", "lanl32")
TUNING = ("kth100", "kth100x0.8", "kth100x0.75", "kth-pools")
# candidates rejected on the tuning scenarios: replayed there only (their held-out rows are in
# the notes, from the run that rejected them)
REJECTED = TUNING
CANDIDATE_KNOBS: tuple[tuple[dict[str, Any], tuple[str, ...] | None], ...] = (
    ({**AGE, "reserve_slowdown": SLOWDOWN_B}, REJECTED),
    ({**AGE, **RUNTIMES}, REJECTED),
    ({**AGE, "backfill_order": "shortest"}, REJECTED),
    ({**AGE, "backfill_bound": "timeout"}, REJECTED),
    (AGE, None),
    ({**AGE, "reserve_wide_frac": WIDE_FRAC}, None),
)


def _candidates() -> tuple[Variant, ...]:
    """The learned-estimate candidates on top of the controller's settings; the one whose
    settings are the controller's own defaults is labelled the default (and replayed once)."""
    out = []
    default_found = False
    for knobs, only in CANDIDATE_KNOBS:
        label = _method("easy", "learned", knobs)
        is_default = controller_settings(estimates="learned", policy="easy", **knobs) == DEFAULTS
        if is_default:
            default_found = True
            label = f"default: {label}"
        out.append(Variant(label, "easy", "learned", knobs, controller=True, only=only))
    if not default_found:
        label = f"default: {_method(DEFAULTS.policy, DEFAULTS.estimates, {})}"
        out.append(Variant(label, DEFAULTS.policy, DEFAULTS.estimates, controller=True))
    return tuple(out)


VARIANTS = (
    Variant("fcfs", "fcfs", only=EXPLAIN),
    Variant("greedy (seed)", "greedy"),
    Variant("easy/timeout", "easy"),
    Variant("conservative/timeout", "conservative", only=EXPLAIN),
    Variant("easy/learned", "easy", "learned", only=EXPLAIN),
    *_candidates(),
)
DEFAULT = next(v for v in VARIANTS if v.label.startswith("default: "))
# the methods held to the targets: the default and every reservation-trigger candidate
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
MEAN_TOLERANCE = 1.10

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
    started = time.perf_counter()
    result = simulate(
        trace,
        pools,
        variant.policy,
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
- **Default.** easy + learned estimates (0.8 quantile of the job key's last 20 runtimes, after 3
  runs; the timeout until then) + reservations only for jobs that waited 5 h (Slurm's
  `bf_min_age_reserve`); the row is built from `AdmissionSettings()`, so it is what the controller
  runs. Young jobs backfill greedily, which keeps greedy's mean wait; a job that has waited 5 h is
  protected like EASY's head, which bounds wide-job waits. Classic EASY with timeout estimates
  misses the mean-wait target on KTH (x1.19) and LANL/32 (x1.31); learned estimates alone recover
  little; the age threshold is what closes the gap. The 5 h was chosen by sweeping scenarios that
  included LANL/32 and the InferenceX mix, so only LANL/16 and the heavier replays are truly held
  out for it.
- **Heavier load.** KTH x0.75 (offered 0.93) tunes; LANL/32 and LANL/16 at arrivals x0.8 (the
  trace's first 30,000 jobs, offered 0.94) and the mix at x0.7 (0.8 on its GB200/GB300 pools)
  are held out. KTH x0.7 and the mix at x0.5 offer more than the capacity (1.0; 1.1 on the GB
  pools): the backlog only grows, so they are not replayed here.
- **Tuning the workload-derived triggers (KTH only: kth100, x0.8, x0.75, pools).** Ratios are
  wide max / classic EASY and mean / greedy, from sweeps before the held-out replays.
  `reserve_after_runtimes` k reserves a blocked job once it waited k x a quantile of the
  estimated runtimes of the leases running on its pools. Uncapped (k x p50 for k = 0.5, 1, 2;
  k x p90 for k = 0.25, 0.5, 1) every setting missed kth100's wide max (x1.21, x1.21, x1.63;
  x1.22, x1.21, x1.35), shorter and longer triggers alike: one wide job sets each maximum, and
  moving the trigger either way moved kth100's by 20% or more. Capped by the 5 h (the shorter
  of the two waits), 0.5 x p50 (worst wide x1.036), 2 x p50 (x0.993), 0.5 x p90 and 1 x p90
  (x0.994, within 1% of the default's ratios) met both targets on all four; 1 x p50 missed
  kth100's wide max (x1.072).
  The rule, fixed before the held-out replays: the lowest worst wide ratio, then the setting that
  departs from the default most, so min(5 h, 2 x running p50).
- **EASY++ order** (`backfill_order` shortest: jobs due a reservation in priority order, the
  younger ones shortest estimate first; Tsafrir, Etsion and Feitelson, "Backfilling Using
  System-Generated Predictions Rather than User Runtime Estimates", IEEE TPDS 2007). Its other two
  parts are already in every learned row: estimates from the job key's history, and an overrun
  estimate extended by `overrun_extension_s` at every plan. With the 5 h trigger it gives the best
  mean on the pools (x0.818) but misses KTH x0.8's wide max (x1.153), so on the split's rule it
  cannot be the default; with min(5 h, 1 x p50) it missed x0.8 (x1.100) and x0.75 (x1.064).
- **An age factor** in the priority (Slurm multifactor's) was not tried: in the SWF replays a
  job's score is its arrival rank, so the priority order already is the age order and an age
  weight changes nothing there; only the InferenceX mix has scores for it to act on.
- **The slowdown trigger** (`reserve_slowdown` B = 1, chosen on KTH earlier: wait / max(estimate,
  10 s) >= B) misses KTH x0.8's wide max (x1.115) and, held out, LANL/32's mean (x1.158).
- **Wide jobs at once** (`reserve_wide_frac` f: a blocked job needing more than f of its largest
  compatible pool is reserved at once, the others keep the 5 h trigger; the issue's "reserve at
  once for jobs wider than a fraction of the pool"). Swept on KTH only (kth100, x0.8, x0.75,
  pools) before any held-out replay; ratios are wide max / classic EASY and mean / greedy:
  f = 0.25 misses kth100's mean (x1.14); 0.35, 0.4 and 0.45 miss KTH x0.8's wide max (x1.120,
  one job of 140.7 h); 0.5 and 0.55 meet all four (worst wide x1.000 on kth100, worst mean
  x1.09 on kth100); 0.6 misses kth100's mean by a hair (x1.105); 0.75 misses KTH x0.8's wide max
  (x1.39). The rule, fixed before the held-out replays: the lowest worst wide ratio, then the
  lowest worst mean, then the smaller f: 0.5. The band that meets all four is narrow (one wide
  job sets each maximum), and on KTH it is not better than the default (worst wide x0.994).
- **Timeout-bounded backfill** (`backfill_bound` timeout: beside a reservation a job is checked
  for its whole timeout, the kill bound, so a learned estimate that was too short cannot delay
  the reserved job, as in EASY with user limits; learned estimates still set the reservations).
  KTH only: with the 5 h trigger it misses kth100 (x1.146) and KTH x0.8 (x1.115); with
  reservations at once it keeps kth100's wide max at EASY's (x1.000) but its mean is x1.17 of
  greedy; with f = 0.5 it misses KTH x0.8 (x1.065). Rejected on KTH.
- **A diagnostic on held-out data, not used to choose.** While the candidates above were tuned,
  an existing arm (easy with learned estimates and reservations at once, i.e. no 5 h trigger)
  was replayed on LANL/32 x0.8: wide max 139.92 h (x1.19 of classic EASY), mean x0.995 of
  greedy. So under heavy load the miss follows the learned estimates, not the 5 h trigger: the
  protected job starts later than classic EASY's because its start is planned on predictions
  that running and backfilled jobs overrun. The next thing to try is on the estimate side
  (a higher estimate_quantile on KTH alone: 0.95 misses KTH x0.75's wide max, x1.060; 1.0 meets
  all four with worst wide x1.039 and worst mean x1.07). Replayed afterwards on the two heavy
  LANL scenarios outside this benchmark, q = 1.0 is no fix either: LANL/32 x0.8 wide x1.079 but
  mean x1.120 of greedy, LANL/16 x0.8 wide x1.568.
- **Held out, the result.** The heavy held-out replays still miss: the 5 h default keeps the
  mean (x1.023 and x0.861 of greedy) but its wide max is x1.179 of classic EASY on LANL/32 x0.8
  and x1.617 on LANL/16 x0.8. Wide jobs at once (f = 0.5) barely touches LANL/32 (only its 6
  jobs of 32 nodes need more than 16: the same schedule at x0.8, means within 0.1% at native
  load), lowers LANL/16
  x0.8's wide max only a little (x1.576, mean x1.004) and misses the mix's mean at x0.7 (x1.125
  of greedy, where the default has x1.054). It does worse than the default held out, so the
  default is unchanged. The heavy LANL misses stay open: on LANL/32 x0.8 classic EASY's own
  mean is x1.217 of greedy, so a method at EASY's wide max there gives up most of the mean
  target; on LANL/16 x0.8 the methods tried sit at x1.16 (slowdown, which misses LANL/32's
  mean) to x1.62 of EASY.
- **Earlier candidates held out** (run aa07954, same scenarios and code for those options; not
  replayed here, having failed on KTH): min(5 h, 2 x running p50) missed LANL/16's wide max at
  native load (x1.140), LANL/32's mean (x1.103), LANL/32 x0.8 (x1.152) and LANL/16 x0.8
  (x1.261); the EASY++ order missed LANL/16 (x1.150), LANL/32 x0.8 (x1.181) and LANL/16 x0.8
  (x1.607); the slowdown trigger missed LANL/32's mean (x1.158) and every LANL/16 wide max. On
  the mix at x0.7 all three met both targets.
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
    """One method against the targets on one scenario; greedy and classic EASY are measured in
    the same run."""
    greedy = by_label["greedy (seed)"][1]
    easy = by_label["easy/timeout"][1]
    wide_ratio = metrics["wide_max_wait_h"] / max(easy["wide_max_wait_h"], 1e-9)
    mean_ratio = metrics["mean_wait_h"] / max(greedy["mean_wait_h"], 1e-9)
    greedy_at_bound = greedy["utilization"] >= 0.99 * greedy["utilization_bound"]
    util_ok = not greedy_at_bound or metrics["utilization"] >= 0.99 * metrics["utilization_bound"]
    misses = []
    if wide_ratio > WIDE_TOLERANCE:
        misses.append(f"wide max +{(wide_ratio - 1) * 100:.1f}%")
    if mean_ratio > MEAN_TOLERANCE:
        misses.append(f"mean +{(mean_ratio - MEAN_TOLERANCE) * 100:.1f} pts over 1.10")
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
        "greedy_mean": greedy["mean_wait_h"],
        "mean_ratio": mean_ratio,
        "util": metrics["utilization"],
        "greedy_util": greedy["utilization"],
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
        f"Targets: wide max wait <= {WIDE_TOLERANCE:.2f} x easy/timeout's (classic EASY; 5% "
        f"for its tie rules); mean wait <= {MEAN_TOLERANCE:.2f} x greedy's; utilization "
        "within 1% of the bound wherever greedy reaches it. Greedy and classic EASY are "
        "measured in the same run. Split: every method and constant was chosen on the "
        f"tuning scenarios ({', '.join(TUNING)}, all KTH); the held-out scenarios were only "
        "replayed afterwards.",
        "",
        "| split | scenario | method | wide max: method / easy-timeout "
        "| mean wait: method / greedy | util: method / greedy | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in sorted(targets, key=lambda t: t["split"] != "tuning"):
        lines.append(
            f"| {t['split']} | {t['scenario']} | {t['method']} "
            f"| {fmt(t['wide_max'])} / {fmt(t['easy_wide_max'])} (x{t['wide_ratio']:.3f}) "
            f"| {fmt(t['mean'])} / {fmt(t['greedy_mean'])} (x{t['mean_ratio']:.3f}) "
            f"| {t['util']:.3f} / {t['greedy_util']:.3f} | {t['met']} |"
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
    scenario: Scenario, limit: int | None, out: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every variant on one scenario, its target rows and its charts."""
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
    if scenario.key in ("kth100", "inferencex"):
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
    add_output_flags(parser, f"the first {SMOKE_JOBS} jobs of every scenario")
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
        futures = {s.key: pool.submit(replay_scenario, s, limit, out) for s in longest_first}
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
            f"x{t['wide_ratio']:.3f} of easy, mean x{t['mean_ratio']:.3f} of greedy: {t['met']}"
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
