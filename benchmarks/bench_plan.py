"""Plan time of the admission planner: 1,000 runners x 500 queued jobs against 100 x 50.

Jobs are drawn from the real InferenceX multi-node mix (slurmgate/data/inferencex-job-mix.csv:
node counts and cluster pools), runners are spread over the mix's pools in proportion to its rows,
and about a third of each pool is already leased to running jobs. Both sizes are timed in the
same run; the ratio shows how plan time scales with 10x the fleet and 10x the queue.

Run: .venv/bin/python benchmarks/bench_plan.py [--repeat N] [--smoke] [--results-dir DIR]
Writes benchmarks/results/plan.json and benchmarks/results/plan.md. The sizes are cheap, so
`--smoke` keeps them and only cuts the repeats to 5.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import statistics
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from options import SMOKE_NOTE, add_output_flags, results_dir

from slurmgate.admission.model import Job, JobStatus, Runner, Snapshot
from slurmgate.admission.planner import plan
from slurmgate.settings.admission import AdmissionSettings

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIX = REPO / "slurmgate" / "data" / "inferencex-job-mix.csv"
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SETTINGS = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True)
SCORES = ["0.000", "1.000", "1.250", "2.250", "3.000", "4.500", "6.000"]


def load_mix() -> list[tuple[str, int]]:
    with MIX.open() as handle:
        return [(row["cluster_pool"], int(row["total_nodes"])) for row in csv.DictReader(handle)]


def build(runner_count: int, job_count: int, seed: int = 1) -> Snapshot:
    rng = random.Random(seed)
    mix = load_mix()
    rows_per_pool = Counter(pool for pool, _ in mix)
    legacy = runner_count // 20
    budget = runner_count - legacy
    total_rows = sum(rows_per_pool.values())
    sizes = {pool: max(1, budget * n // total_rows) for pool, n in rows_per_pool.items()}
    first = sorted(sizes)[0]
    sizes[first] += budget - sum(sizes.values())

    runners: list[Runner] = []
    jobs: list[Job] = []
    rid, job_id = 1, 1
    for pool in sorted(sizes):
        members = []
        for _ in range(sizes[pool]):
            online = rng.random() > 0.05
            members.append(
                Runner(rid, f"{pool}-{rid}", online, False, ("self-hosted", "Linux", pool))
            )
            rid += 1
        # lease about a third of the pool to running jobs of 1-4 nodes
        cursor, target = 0, len(members) // 3
        while cursor < target:
            size = min(rng.randint(1, 4), target - cursor)
            job_id += 1
            gate = (f"ci-job-1.000-r{job_id}", "ci-attempt-1", f"nodes:{size}")
            label = f"ci-lease-j{job_id}-a1-t{int(NOW.timestamp()) - 600}"
            for k in range(size):
                r = members[cursor + k]
                extra = (label, *gate) if k == 0 else (label,)
                members[cursor + k] = Runner(r.id, r.name, r.online, True, (*r.labels, *extra))
            jobs.append(
                Job(
                    job_id,
                    job_id,
                    1,
                    f"running-{job_id}",
                    ("self-hosted", pool, *gate),
                    JobStatus.IN_PROGRESS,
                    NOW - timedelta(seconds=700),
                )
            )
            cursor += size
        runners.extend(members)
    for _ in range(legacy):
        runners.append(Runner(rid, f"legacy-{rid}", True, False, ("self-hosted", "Linux")))
        rid += 1
    for _ in range(job_count):
        job_id += 1
        pool, nodes = rng.choice(mix)
        labels = (
            "self-hosted",
            pool,
            f"ci-job-{rng.choice(SCORES)}-q{job_id}",
            "ci-attempt-1",
            f"nodes:{nodes}",
        )
        jobs.append(
            Job(
                job_id,
                job_id,
                1,
                f"queued-{job_id}",
                labels,
                JobStatus.QUEUED,
                NOW - timedelta(seconds=rng.randint(0, 3000)),
            )
        )
    return Snapshot(tuple(runners), tuple(jobs), NOW)


def measure(snap: Snapshot, repeat: int) -> dict[str, float | int]:
    plan(snap, SETTINGS, NOW)  # warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        decisions = plan(snap, SETTINGS, NOW)
        times.append((time.perf_counter() - start) * 1000)
    return {
        "runners": len(snap.runners),
        "queued_jobs": sum(1 for j in snap.jobs if j.status == JobStatus.QUEUED),
        "median_ms": round(statistics.median(times), 3),
        "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
        "min_ms": round(min(times), 3),
        "admitted": len(decisions.admit),
        "blocked": len(decisions.blocked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    add_output_flags(parser, "5 repeats instead of 30 (same sizes)")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = min(args.repeat, 5)

    small = measure(build(100, 50), args.repeat)
    large = measure(build(1000, 500), args.repeat)
    ratio = large["median_ms"] / small["median_ms"]
    result = {
        "benchmark": "plan",
        "python": platform.python_version(),
        "repeat": args.repeat,
        "small": small,
        "large": large,
        "ratio_large_over_small": round(ratio, 2),
        "target_ms_large": 100,
        "meets_target": large["median_ms"] < 100,
        "smoke": args.smoke,
    }
    out = results_dir(args)
    (out / "plan.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# plan() time",
        "",
        f"Median of {args.repeat} runs, Python {result['python']}; "
        "jobs drawn from the InferenceX multi-node mix, a third of each pool already leased.",
        "",
        "| fleet | queued jobs | median ms | p90 ms | admitted | blocked |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in (small, large):
        lines.append(
            f"| {row['runners']} | {row['queued_jobs']} | {row['median_ms']} | {row['p90_ms']} "
            f"| {row['admitted']} | {row['blocked']} |"
        )
    lines += [
        "",
        f"Ratio large / small (10x runners, 10x jobs): **{result['ratio_large_over_small']}x**. "
        f"Target for 1,000 x 500: under 100 ms "
        f"({'met' if result['meets_target'] else 'NOT met'}).",
        "",
    ]
    if args.smoke:
        lines += [SMOKE_NOTE, ""]
    (out / "plan.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
