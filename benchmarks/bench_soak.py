"""A soak on the GitHub emulator: two controllers, 5 % faults and SIGKILLs, 2 simulated hours.

200 runners in 4 pools of the InferenceX job mix (slurmgate/data/inferencex-job-mix.csv), its
jobs arriving in their workflow-run batches and finishing as GitHub finishes them; two
controllers run the real reconcile tick on overlapping schedules (every 30 and 37 simulated
seconds) while the emulator answers about 5 % of GitHub requests with a 5xx, a 429 or a
secondary-limit 403 with Retry-After, a delay past the client's timeout, or a lost answer after
the write was applied, and a controller is SIGKILLed mid-tick every 10 simulated minutes on
average. After every tick the invariants are checked on the emulator's own state. The same seed
runs again with no faults and no kills, in the same run, for the API calls per admission.

Run: .venv/bin/python benchmarks/bench_soak.py [--sim-s 7200] [--speed 20] [--seed 17]
Writes benchmarks/results/soak.json and benchmarks/results/soak.md.
`--smoke` runs 5 simulated minutes of each arm (15 s each at 20x); `--results-dir DIR` writes
elsewhere.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from options import add_output_flags, write_results

from slurmgate.testbed.soak import SoakConfig, run_soak


def run(sim_s: float, speed: float, seed: int, runtime_scale: float) -> dict[str, Any]:
    faulty = SoakConfig(seed=seed, sim_s=sim_s, speed=speed, runtime_scale=runtime_scale)
    if sim_s < 1800:  # a smoke run: kill more often so at least one kill lands
        faulty = faulty.model_copy(update={"kill_mean_s": sim_s / 2})
        # At 20x the default 20 s anchor window is one wall second, shorter than one
        # timeout fault: on a loaded machine every admission of a batch would roll back.
        faulty = faulty.model_copy(update={"orphan_grace_s": 120.0})
    clean = faulty.model_copy(update={"fault_rate": 0.0, "kill_mean_s": None})
    with tempfile.TemporaryDirectory(prefix="slurmgate-soak-") as logs:
        soaked = run_soak(faulty, log_dir=Path(logs) / "faulty")
        baseline = run_soak(clean)
    ratio = None
    if soaked.api_calls_per_admission and baseline.api_calls_per_admission:
        ratio = round(soaked.api_calls_per_admission / baseline.api_calls_per_admission, 2)
    return {
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        "faulty": soaked.model_dump(mode="json"),
        "fault_free": baseline.model_dump(mode="json"),
        "ratio_api_calls_per_admission_faulty_over_fault_free": ratio,
    }


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _row(name: str, report: dict[str, Any]) -> str:
    faults = sum(report["faults_injected"].values())
    return (
        f"| {name} | {report['wall_s']:.0f} | {report['sim_s']:.0f} | {report['ticks']} | "
        f"{report['admissions']} | {report['admissions_reported']} | {report['jobs_completed']} | "
        f"{faults} | {report['client_retries']} | {report['rollbacks']} | "
        f"{report['kills_mid_tick']} | {report['violations_total']} | {report['api_calls']} | "
        f"{report['api_calls_per_admission']} |"
    )


def markdown(result: dict[str, Any]) -> str:
    faulty, clean = result["faulty"], result["fault_free"]
    config = faulty["config"]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(faulty["faults_injected"].items()))
    lines = [
        "# Soak: two controllers on the emulator, with faults and SIGKILLs",
        "",
        f"{sum(config['pools'].values())} runners in {len(config['pools'])} pools "
        f"({', '.join(f'{k}={v}' for k, v in config['pools'].items())}), InferenceX job mix "
        f"(offered load {config['offered_load']}, runtimes x{config['runtime_scale']}), "
        f"{config['sim_s'] / 3600:.1f} simulated hours at {config['speed']:.0f}x, controllers "
        f"every {config['tick_periods_s'][0]:.0f} s and {config['tick_periods_s'][1]:.0f} s, "
        f"orphan grace {config['orphan_grace_s']:.0f} s, seed {config['seed']}. Faults on "
        f"{config['fault_rate']:.0%} of GitHub requests (Retry-After {config['retry_after_s']} "
        f"wall s, timeout faults {config['timeout_delay_s']} wall s against a "
        f"{config['client_timeout_s']} s client timeout); a SIGKILL mid-tick every "
        f"{config['kill_mean_s']} simulated s on average. Machine: {result['machine']['cpus']} "
        "CPUs.",
        "",
        "| run | wall s | sim s | ticks | admissions | reported | jobs completed | faults | "
        "client retries | rollbacks | SIGKILLs | violations | API calls | calls / admission |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        _row("faults + kills", faulty),
        _row("fault-free", clean),
        "",
        f"Faults injected by kind: {kinds or 'none'}.",
        f"Invariant checks: {faulty['checks']} (after every tick), violations: "
        f"{faulty['violations'] or 'none'}; fault-free: {clean['violations'] or 'none'}.",
        f"Ticks with a decision that failed after retries: {faulty['ticks_with_failures']}.",
        f"Jobs that held two committed leases at once (over-reservation, not a violation): "
        f"{faulty['duplicate_leases']} (fault-free: {clean['duplicate_leases']}).",
        "",
        "Ratio API calls per admission, faults + kills / fault-free: "
        f"**{result['ratio_api_calls_per_admission_faulty_over_fault_free']}**",
        "",
        "Admissions are the jobs GitHub started (each was admitted by one controller); "
        "`reported` is what the controllers' tick reports counted, which misses the admissions "
        "of ticks killed before they reported. Time is compressed: client timeouts, backoffs "
        "and Retry-After waits stay in wall seconds, so each fault costs the controllers "
        f"{config['speed']:.0f} times more simulated time than it would at 1x.",
    ]
    if faulty["evidence"]:
        lines += ["", "First violations:", ""]
        lines += [f"- {v['invariant']} at {v['at_s']} s: {v['detail']}" for v in faulty["evidence"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim-s", type=float, default=7200.0)
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--runtime-scale", type=float, default=0.5)
    add_output_flags(parser, "5 simulated minutes of each arm")
    args = parser.parse_args()
    if args.smoke:
        # at 20x (the full run's speed): at 40x, on two cores busy with other tests, the
        # fault-free arm's 7.5 wall seconds once ended before its first admission
        args.sim_s, args.runtime_scale = min(args.sim_s, 300.0), 0.1
    result = run(args.sim_s, args.speed, args.seed, args.runtime_scale)
    result["smoke"] = args.smoke
    write_results(args, "soak", result, markdown(result))


if __name__ == "__main__":
    main()
