"""One reconcile tick on the emulator: 1,000 runners and 500 queued jobs, against an idle tick.

The fleet spreads 1,000 runners over the pools of the real InferenceX job mix
(slurmgate/data/inferencex-job-mix.csv) in proportion to its rows; 500 queued jobs draw their
pool and node count from the same mix, 10 jobs per workflow run (a matrix). The busy tick reads
everything cold, plans, and admits through the Prefect flow (one `lease` task run per
admission); the idle tick that follows (nothing changed) must cost no primary quota. Both are
measured in the same run, with the planner timed on its own over the same snapshot, and the busy
tick again without Prefect on equal work (`core_tick`: the core's `reconcile_tick` with the
plain steps, on a twin emulator with the same fleet and queue), which gives flow / core.

Run: .venv/bin/python benchmarks/bench_reconcile.py [--runners 1000] [--jobs 500]
Writes benchmarks/results/reconcile.json and benchmarks/results/reconcile.md.
`--smoke` runs both ticks on 24 runners and 8 jobs; `--results-dir DIR` writes elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from options import add_output_flags, write_results

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIX = REPO / "slurmgate" / "data" / "inferencex-job-mix.csv"
SCORES = ["1.000", "1.250", "2.250", "3.000", "4.500"]
JOBS_PER_RUN = 10


def load_mix() -> list[tuple[str, int]]:
    with MIX.open() as handle:
        return [
            (row["cluster_pool"].removeprefix("cluster:"), int(row["total_nodes"]))
            for row in csv.DictReader(handle)
        ]


def fleet_sizes(mix: list[tuple[str, int]], runners: int) -> dict[str, int]:
    rows = Counter(pool for pool, _ in mix)
    total = sum(rows.values())
    sizes = {pool: max(1, runners * n // total) for pool, n in sorted(rows.items())}
    first = next(iter(sizes))
    sizes[first] += runners - sum(sizes.values())
    return sizes


def queue_jobs(emu: Any, mix: list[tuple[str, int]], count: int, seed: int) -> Counter[int]:
    rng = random.Random(seed)
    sizes: Counter[int] = Counter()
    run_id = None
    for i in range(count):
        pool, nodes = rng.choice(mix)
        labels = [
            "self-hosted",
            f"cluster:{pool}",
            f"ci-job-{rng.choice(SCORES)}-b{i}",
            "ci-attempt-1",
            f"nodes:{nodes}",
        ]
        created = emu.admin.add_job(labels, duration_s=3600, run_id=run_id)
        run_id = None if (i + 1) % JOBS_PER_RUN == 0 else created["run_id"]
        sizes[nodes] += 1
    return sizes


def median_plan_s(snapshot: Any, settings: Any, repeat: int) -> float:
    from slurmgate.admission.planner import plan

    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        plan(snapshot, settings, datetime.now(UTC))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def core_logger(path: Path | None = None) -> logging.Logger:
    """The core arm's tick log: the same lines the flow logs, through the standard library
    (to `path`, or dropped), so both arms format and write them."""
    logger = logging.getLogger("slurmgate.bench.core_tick")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for old in list(logger.handlers):
        logger.removeHandler(old)
        old.close()
    handler: logging.Handler = logging.FileHandler(path) if path else logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger


async def core_tick(
    emu: Any, settings: Any, log: logging.Logger | None = None
) -> tuple[dict[str, Any], float]:
    """The flow's tick without Prefect, on equal work: `reconcile_tick` with the plain steps
    (`direct_steps`: the bare lease protocol, releases and the re-plan included), the flow's
    settings, its client options (inline scope: $SLURMGATE_MIN_WRITE_INTERVAL_S, the file ETag
    cache), its job-event reads, an empty runtime history and a log of the same lines.
    Returns the tick's counts and its wall time."""
    from slurmgate.admission.estimates import RuntimeHistory
    from slurmgate.admission.tick import reconcile_tick
    from slurmgate.controller.steps import direct_steps
    from slurmgate.github.factory import client_for_scope
    from slurmgate.github.scope import GitHubScope
    from slurmgate.github.snapshot import EventReads

    pacing = float(os.environ.get("SLURMGATE_MIN_WRITE_INTERVAL_S", "").strip() or 1.0)
    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    started = time.perf_counter()
    async with client_for_scope(scope, emu.token, min_write_interval_s=pacing) as client:
        steps = direct_steps(client, settings=settings, events=EventReads.configured())
        report = await reconcile_tick(steps, settings, history=RuntimeHistory(), log=log)
    return report.counts(), time.perf_counter() - started


async def snapshot_of(emu: Any) -> Any:
    from slurmgate.github.client import GitHubClient
    from slurmgate.github.scope import GitHubScope
    from slurmgate.github.snapshot import take_snapshot

    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token) as client:
        return await take_snapshot(client)


@contextlib.contextmanager
def test_harness() -> Iterator[None]:
    """Prefect's test harness, its fresh database a copy of $SLURMGATE_PREFECT_DB_TEMPLATE when
    that is set (as the tests set it; tests/conftest.py seeds its harness the same way): the
    server starts without ~10 CPU s of migrations. Unset, the harness migrates as always."""
    import prefect.testing.utilities as harness

    from slurmgate.prefect_db import seed_prefect_database

    fresh = harness.mkdtemp

    def seeded() -> str:
        folder: str = fresh()
        seed_prefect_database(Path(folder), "prefect-test.db")
        return folder

    harness.mkdtemp = seeded
    try:
        with harness.prefect_test_harness(server_startup_timeout=90):
            yield
    finally:
        harness.mkdtemp = fresh


def run(runners: int, jobs: int, seed: int) -> dict[str, Any]:
    from slurmgate.flows.reconcile import reconcile
    from slurmgate.settings.admission import AdmissionSettings
    from slurmgate.testbed.emulator.testing import running_emulator

    mix = load_mix()
    pools = fleet_sizes(mix, runners)
    settings = AdmissionSettings()
    with test_harness(), running_emulator(pools) as emu:
        os.environ["GITHUB_TOKEN"] = emu.token
        sizes = queue_jobs(emu, mix, jobs, seed)
        before = asyncio.run(snapshot_of(emu))
        plan_alone_s = median_plan_s(before, settings, repeat=5)

        emu.admin.reset_stats()
        started = time.perf_counter()
        busy = asyncio.run(reconcile(scope_block=None, api_url=emu.url, repo=emu.repo))
        busy_wall = time.perf_counter() - started
        busy_stats = emu.admin.stats()

        after = asyncio.run(snapshot_of(emu))
        from slurmgate.admission.model import leases_from_fleet

        leases, _ = leases_from_fleet(after.runners)
        admitted_nodes = [lease.size for lease in leases]

        asyncio.run(reconcile(scope_block=None, api_url=emu.url, repo=emu.repo))  # absorbs dispatch
        emu.admin.reset_stats()
        started = time.perf_counter()
        idle = asyncio.run(reconcile(scope_block=None, api_url=emu.url, repo=emu.repo))
        idle_wall = time.perf_counter() - started
        idle_stats = emu.admin.stats()

    with running_emulator(pools) as twin:  # the same fleet and queue, driven without Prefect
        queue_jobs(twin, mix, jobs, seed)
        core_counts, core_wall = asyncio.run(core_tick(twin, settings, core_logger()))
        core_admitted = core_counts["admitted"]

    writes_budget = sum(n + 1 for n in admitted_nodes)
    return {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "fleet": {"runners": runners, "pools": len(pools), "queued_jobs": jobs},
        "job_sizes": dict(sorted(sizes.items())),
        "busy_tick": {
            "wall_s": round(busy_wall, 3),
            "plan_s_in_flow": busy["plan_s"],
            "admitted": busy["admitted"],
            "blocked": busy["blocked"],
            "rolled_back": busy["rolled_back"],
            "admitted_nodes": sum(admitted_nodes),
            "label_writes": busy_stats["writes"],
            "label_writes_budget_n_plus_1": writes_budget,
            "requests": busy_stats["total"],
            "quota_used": busy_stats["quota_used"],
        },
        "plan_alone_median_s": round(plan_alone_s, 6),
        "core_tick_without_prefect": {"wall_s": round(core_wall, 3), "admitted": core_admitted},
        "idle_tick": {
            "wall_s": round(idle_wall, 3),
            "plan_s_in_flow": idle["plan_s"],
            "requests": idle_stats["total"],
            "not_modified": idle_stats["not_modified"],
            "quota_used": idle_stats["quota_used"],
            "writes": idle_stats["writes"],
        },
        "ratios": {
            "plan_share_of_busy_tick": round(busy["plan_s"] / busy_wall, 5),
            "busy_over_idle_wall": round(busy_wall / idle_wall, 2),
            "prefect_tick_over_core_tick": round(busy_wall / core_wall, 2),
            "writes_per_admitted_job": round(busy_stats["writes"] / max(1, busy["admitted"]), 2),
            "writes_over_n_plus_1_budget": round(busy_stats["writes"] / max(1, writes_budget), 3),
            # reads beyond the tick's own snapshot (which the idle tick shows): verification
            "verify_reads_per_admitted_job": round(
                (busy_stats["total"] - busy_stats["writes"] - idle_stats["total"])
                / max(1, busy["admitted"]),
                2,
            ),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    busy, idle, ratios = result["busy_tick"], result["idle_tick"], result["ratios"]
    fleet = result["fleet"]
    lines = [
        "# Reconcile tick on the emulator",
        "",
        f"{fleet['runners']} runners in {fleet['pools']} pools, {fleet['queued_jobs']} queued "
        "jobs (InferenceX mix), Prefect test server (SQLite), no write pacing.",
        "",
        "| measure | busy tick | idle tick | ratio |",
        "|---|---|---|---|",
        f"| wall time (s) | {busy['wall_s']} | {idle['wall_s']} | "
        f"{ratios['busy_over_idle_wall']}x |",
        f"| plan time in the flow (s) | {busy['plan_s_in_flow']} | {idle['plan_s_in_flow']} | "
        f"plan = {ratios['plan_share_of_busy_tick']:.2%} of the busy tick |",
        f"| requests | {busy['requests']} | {idle['requests']} | |",
        f"| primary quota used | {busy['quota_used']} | {idle['quota_used']} | |",
        f"| 304 Not Modified | | {idle['not_modified']} | |",
        f"| label writes | {busy['label_writes']} | {idle['writes']} | "
        f"{ratios['writes_over_n_plus_1_budget']} of the N+1 budget |",
        "",
        f"Admitted {busy['admitted']} jobs ({busy['admitted_nodes']} nodes), blocked "
        f"{busy['blocked']}, rolled back {busy['rolled_back']}; "
        f"{ratios['writes_per_admitted_job']} writes per admitted job, budget N+1 = "
        f"{busy['label_writes_budget_n_plus_1']} writes in all.",
        f"Verification reads fresh (unconditional) either the chosen runners or every list page, "
        f"whichever is fewer: {ratios['verify_reads_per_admitted_job']} read requests per "
        "admitted job here.",
        f"Planner alone on the same snapshot: median {result['plan_alone_median_s']} s.",
        "The same busy tick without Prefect, on equal work (`reconcile_tick` with the plain "
        "steps, the flow's settings and client options, twin emulator): "
        f"{result['core_tick_without_prefect']['wall_s']} s for "
        f"{result['core_tick_without_prefect']['admitted']} admissions; the flow takes "
        f"{ratios['prefect_tick_over_core_tick']}x that (flow / core; one `lease` task run per "
        "admission).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=7)
    add_output_flags(parser, "24 runners and 8 queued jobs")
    args = parser.parse_args()
    if args.smoke:
        args.runners, args.jobs = min(args.runners, 24), min(args.jobs, 8)
    os.environ.setdefault("PRIORITY_SCHEDULER_ENABLED", "true")
    os.environ.setdefault("NODE_SLOT_SCHEDULER_ENABLED", "true")
    os.environ.setdefault("SLURMGATE_MIN_WRITE_INTERVAL_S", "0")
    os.environ["SLURMGATE_STATE_DIR"] = tempfile.mkdtemp(prefix="slurmgate-bench-state-")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    result = run(args.runners, args.jobs, args.seed)
    result["smoke"] = args.smoke
    write_results(args, "reconcile", result, markdown(result))


if __name__ == "__main__":
    main()
