"""Admission latency: a job queued -> its anchor label written, by the admission loop vs polling.

Everything runs in one process against one real Prefect server (`prefect server start` on a
free loopback port, SQLite, in a temporary PREFECT_HOME: the embedded default) and a fresh
GitHub emulator per arm, with `deployments/serve.py` in a subprocess:

- **events**: `serve.py --events`: the emulator sends signed `workflow_job` webhooks to
  `slurmgate webhook`'s relay, which posts Prefect events; the admission loop in the served
  process (flows/admission_loop.py) wakes on them and runs reconcile there, as a run of the
  deployment. One-node jobs at random gaps, then N-node jobs (`--nodes`, default 2 and 4),
  then a burst of 50 queued jobs whose reconcile runs are counted.
- **polling** (the outside reference): the same deployment with only its interval schedule,
  each run a new process started by the runner's poll (`PREFECT_RUNNER_POLL_FREQUENCY`).
- **floor**: the core protocol alone, without Prefect: `admission/tick.reconcile_tick` over
  `github/steps.direct_steps`, started the moment the job is queued, in this process. What the
  admission costs when nothing waits: the read, the plan and the N + 1 writes paced by
  `min_write_interval_s`.

Labels are written with `--write-interval` between writes (1 s: the scope block's default and
GitHub's advice). The N-node bound is (N + 1) x write interval + 2 s. Latency is measured from the
emulator accepting the job to the first moment its `ci-job-*` label is on a runner (sampled
every 20 ms from the emulator's state).

Run: .venv/bin/python benchmarks/bench_events.py [--interval 30] [--jobs 8] [--runner-poll 10]
Writes benchmarks/results/events.json and .md (`--out NAME` for another stem, `--results-dir DIR`
for another directory). About 6 minutes. `--smoke`: 3 one-node jobs per arm at 0.5-2 s gaps,
one 2-node job, a burst of 10, polling on a 6 s schedule with a 1 s runner poll, labels written
0.25 s apart, one floor tick per size, the Prefect server starting while the floor arm runs:
about 80 s on 2 cores, most of it starting the Prefect server and the two served processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from options import SMOKE_NOTE, add_output_flags, results_dir

from slurmgate.testbed.localproc import stop_group
from slurmgate.testbed.prefect_server import (
    FlowRunSummary,
    deployment_ready,
    deployment_runs,
    running_prefect_server,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECRET = "bench-webhook-secret"
POOL = {"a": 8}
BOUND_SLACK_S = 2.0


class AnchorWatch:
    """Samples the emulator's runners and records when each job token's label first appears."""

    def __init__(self, state: Any, period_s: float = 0.02) -> None:
        self.state = state
        self.period_s = period_s
        self.queued: dict[str, float] = {}
        self.anchored: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self.state.lock:
                labels = set().union(*(r.folded() for r in self.state.runners.values()))
            for token in list(self.queued):
                if token not in self.anchored and f"ci-job-1.000-{token}" in labels:
                    self.anchored[token] = now
            time.sleep(self.period_s)

    def wait(self, tokens: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(t not in self.anchored for t in tokens) and time.monotonic() < deadline:
            time.sleep(0.1)

    def latencies(self, tokens: list[str]) -> list[float]:
        return [self.anchored[t] - self.queued[t] for t in tokens if t in self.anchored]

    def __enter__(self) -> AnchorWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def job_labels(token: str, nodes: int) -> list[str]:
    return ["self-hosted", "cluster:a", f"nodes:{nodes}", f"ci-job-1.000-{token}", "ci-attempt-1"]


def queue(emu: Any, watch: AnchorWatch, prefix: str, nodes: int, duration_s: float) -> str:
    token = f"{prefix}x{uuid.uuid4().hex[:6]}"
    emu.admin.add_job(job_labels(token, nodes), duration_s=duration_s)
    watch.queued[token] = time.monotonic()
    return token


def stats(latencies: list[float], expected: int) -> dict[str, Any]:
    ordered = sorted(latencies)

    def pick(q: float) -> float | None:
        if not ordered:
            return None
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)

    return {
        "latencies_s": [round(x, 3) for x in latencies],
        "anchored": len(latencies),
        "missing": expected - len(latencies),
        "median_s": round(statistics.median(ordered), 3) if ordered else None,
        "p95_s": pick(0.95),
        "mean_s": round(statistics.fmean(ordered), 3) if ordered else None,
        "max_s": round(max(ordered), 3) if ordered else None,
    }


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.3)


def started_between(runs: list[FlowRunSummary], start: float, end: float) -> int:
    """Runs whose start lies in a monotonic window (converted through the wall clock now)."""
    offset = time.time() - time.monotonic()
    return sum(
        1
        for r in runs
        if r.start_time is not None and start + offset <= r.start_time.timestamp() <= end + offset
    )


def run_arm(mode: str, api_url: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from slurmgate.github.webhook import RelayServer, RelaySettings
    from slurmgate.testbed.emulator.testing import running_emulator

    relay = None
    hooks: dict[str, Any] = {}
    if mode == "events":
        relay = RelayServer(RelaySettings(secret=SECRET, prefect_api_url=api_url)).start()
        hooks = {"webhook_urls": [relay.url], "webhook_secret": SECRET}
    rng = random.Random(args.seed)
    name = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
    result: dict[str, Any] = {"mode": mode}
    try:
        with running_emulator(POOL, **hooks) as emu:
            env = {
                **os.environ,
                "PREFECT_API_URL": api_url,
                "PREFECT_RUNNER_POLL_FREQUENCY": str(args.runner_poll),
                "GITHUB_TOKEN": emu.token,
                "PRIORITY_SCHEDULER_ENABLED": "true",
                "NODE_SLOT_SCHEDULER_ENABLED": "true",
                "SLURMGATE_MIN_WRITE_INTERVAL_S": str(args.write_interval),
                "SLURMGATE_STATE_DIR": str(log_dir / f"state-{mode}"),
                "PREFECT_LOGGING_EXTRA_LOGGERS": "slurmgate",
            }
            cmd = [
                sys.executable,
                "-m",
                "slurmgate.deployments.serve",
                "--only",
                "reconcile",
                "--name",
                name,
            ]
            cmd += ["--api-url", emu.url, "--repo", emu.repo]
            if mode == "events":
                cmd += ["--events", "--interval", str(args.interval)]
            else:
                cmd += ["--interval", str(args.poll_interval)]
            with open(log_dir / f"{name}.log", "wb") as log:
                # a session of its own: its flow runs' `prefect.engine` children stop with it
                proc = subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True
                )
            runs = lambda: deployment_runs(api_url, f"reconcile/{name}")  # noqa: E731
            try:
                deadline = time.monotonic() + 90
                while not deployment_ready(api_url, f"reconcile/{name}"):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"serve did not start; see {log_dir / name}.log")
                    time.sleep(0.5)
                # the first run (the loop's start tick, the schedule's immediate run) has ended,
                # so jobs meet a steady state
                wait_for(lambda: any(r.final for r in runs()), 90, "the first reconcile run")
                time.sleep(args.settle)
                with AnchorWatch(emu.state) as watch:
                    tokens = []
                    for i in range(args.jobs):
                        time.sleep(rng.uniform(args.gap_min, args.gap_max))
                        tokens.append(queue(emu, watch, f"{mode[0]}{i}", 1, args.job_s))
                    tail = 30.0 if mode == "events" else args.poll_interval + 4 * args.runner_poll
                    watch.wait(tokens, tail + 30)
                    result["one_node"] = stats(watch.latencies(tokens), len(tokens))
                    if mode == "events":
                        result["n_node"] = n_node_jobs(emu, watch, args, rng)
                        result["burst"] = burst(emu, watch, args, runs)
                result["flow_runs_started"] = sum(1 for r in runs() if r.start_time is not None)
                result["flow_runs_cancelled"] = sum(
                    1 for r in runs() if r.state_type == "CANCELLED"
                )
            finally:
                stop_group(proc, timeout=20)
    finally:
        if relay is not None:
            relay.stop()
    result["relay"] = dict(relay.stats) if relay is not None else None
    return result


def n_node_jobs(
    emu: Any, watch: AnchorWatch, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    """Each N of --nodes, --n-jobs times, one at a time, each queued once the fleet is quiet: the
    bound is the admission's own (its N + 1 paced writes), not the releases of earlier jobs,
    which a tick writes first (paced too) and which the one-node arm meets at random."""
    out: dict[str, Any] = {}
    for nodes in args.nodes:
        tokens = []
        for i in range(args.n_jobs):
            time.sleep(args.job_s)  # the previous job ends, its completed event releases it
            wait_for(lambda: not leased(emu), 60, "the fleet to be released")
            time.sleep(rng.uniform(1.0, 3.0))
            tokens.append(queue(emu, watch, f"n{nodes}-{i}", nodes, args.job_s))
            watch.wait(tokens[-1:], 60)
        bound = (nodes + 1) * args.write_interval + BOUND_SLACK_S
        entry = stats(watch.latencies(tokens), len(tokens))
        entry["bound_s"] = round(bound, 3)
        entry["within_bound"] = entry["max_s"] is not None and entry["max_s"] <= bound
        out[str(nodes)] = entry
    return out


def leased(emu: Any) -> bool:
    with emu.state.lock:
        labels = set().union(*(r.folded() for r in emu.state.runners.values()))
    return any(label.startswith("ci-lease-") for label in labels)


def burst(
    emu: Any, watch: AnchorWatch, args: argparse.Namespace, runs: Callable[[], Any]
) -> dict[str, Any]:
    """`--burst` queued 2-node jobs as fast as the emulator takes them; count reconcile runs."""
    time.sleep(args.job_s)  # the last N-node job ends and is released
    wait_for(lambda: not leased(emu), 60, "the fleet to be released")
    wait_for(lambda: all(r.final for r in runs()), 60, "reconcile runs to finish")
    start = time.monotonic()
    tokens = [queue(emu, watch, f"b{i}", 2, 600.0) for i in range(args.burst)]
    queued_s = time.monotonic() - start
    time.sleep(args.burst_settle)
    wait_for(lambda: all(r.final for r in runs()), 60, "the burst's runs to finish")
    made = started_between(runs(), start, time.monotonic())
    admitted = sum(1 for t in tokens if t in watch.anchored)
    return {
        "jobs": args.burst,
        "queued_in_s": round(queued_s, 3),
        "reconcile_runs": made,
        "admitted": admitted,
        "fits": POOL["a"] // 2,
    }


async def floor_arm(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The core protocol alone: queue, then one direct tick at once (a fresh client, as a run)."""
    from slurmgate.admission.tick import reconcile_tick
    from slurmgate.controller.steps import direct_steps
    from slurmgate.github.factory import client_for_scope
    from slurmgate.github.scope import GitHubScope
    from slurmgate.settings.admission import AdmissionSettings
    from slurmgate.testbed.emulator.testing import running_emulator

    os.environ["SLURMGATE_STATE_DIR"] = str(log_dir / "state-floor")
    settings = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True)
    out: dict[str, Any] = {}
    with running_emulator(POOL) as emu:
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        for nodes in [1, *args.nodes]:
            times = []
            for i in range(args.floor_repeats):
                token = f"f{nodes}-{i}x{uuid.uuid4().hex[:6]}"
                emu.admin.add_job(job_labels(token, nodes), duration_s=0.5)
                queued = time.monotonic()
                client = client_for_scope(
                    scope, emu.token, min_write_interval_s=args.write_interval
                )
                async with client:
                    await reconcile_tick(direct_steps(client, settings=settings), settings)
                times.append(time.monotonic() - queued)
                await asyncio.sleep(1.0)  # the job ends; the next tick releases its lease
                async with client_for_scope(scope, emu.token) as cleaner:
                    await reconcile_tick(direct_steps(cleaner, settings=settings), settings)
            out[str(nodes)] = stats(times, len(times))
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=30.0, help="loop interval floor, s")
    parser.add_argument("--poll-interval", type=float, default=30.0, help="polling schedule, s")
    parser.add_argument("--runner-poll", type=float, default=10.0, help="served runner poll, s")
    parser.add_argument("--write-interval", type=float, default=1.0, help="min write spacing, s")
    parser.add_argument("--jobs", type=int, default=8, help="one-node jobs per arm")
    parser.add_argument("--nodes", type=int, nargs="*", default=[2, 4], help="N-node job sizes")
    parser.add_argument("--n-jobs", type=int, default=3, help="jobs per N-node size")
    parser.add_argument("--burst", type=int, default=50, help="jobs queued in the burst")
    parser.add_argument("--floor-repeats", type=int, default=5)
    parser.add_argument("--job-s", type=float, default=3.0, help="each job's length, s")
    parser.add_argument("--gap-min", type=float, default=4.0)
    parser.add_argument("--gap-max", type=float, default=16.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="events", help="results file stem under results/")
    parser.add_argument(
        "--arms", nargs="*", default=["floor", "events", "polling"], help="arms to run"
    )
    add_output_flags(
        parser,
        "3 one-node jobs per arm at 0.5-2 s gaps, one 2-node job, a burst of 10, "
        "polling on a 6 s schedule with a 1 s runner poll, writes 0.25 s apart",
    )
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/bench_events.py", *sys.argv[1:]])
    args.settle, args.burst_settle = 3.0, 12.0
    if args.smoke:
        args.interval, args.poll_interval = min(args.interval, 12.0), min(args.poll_interval, 6.0)
        args.runner_poll = 1.0
        args.jobs, args.nodes, args.n_jobs = min(args.jobs, 3), args.nodes[:1], 1
        args.burst, args.floor_repeats = min(args.burst, 10), 1
        args.write_interval = min(args.write_interval, 0.25)
        args.gap_min, args.gap_max = min(args.gap_min, 0.5), min(args.gap_max, 2.0)
        args.settle, args.burst_settle, args.job_s = 0.5, 4.0, 2.0

    import tempfile

    log_dir = Path(tempfile.mkdtemp(prefix="slurmgate-bench-events-"))
    os.environ["PREFECT_HOME"] = str(log_dir / "prefect-home")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    started = time.monotonic()
    if set(args.arms) != {"floor", "events", "polling"}:
        args.out += "-partial"  # a partial run never overwrites the committed results

    def run_floor() -> dict[str, Any]:
        return asyncio.run(floor_arm(args, log_dir)) if "floor" in args.arms else {}

    with contextlib.ExitStack() as stack:
        starting = running_prefect_server(log_dir, log=log_dir / "prefect-server.log")
        if args.smoke:  # the server starts while the floor arm (no Prefect) runs beside it
            with ThreadPoolExecutor(1) as pool:
                started_server = pool.submit(stack.enter_context, starting)
                floor = run_floor()
                server = started_server.result()
        else:  # the floor alone on the machine, then the server
            floor = run_floor()
            server = stack.enter_context(starting)
        stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
        arms = {m: run_arm(m, server.api_url, args, log_dir) for m in args.arms if m != "floor"}
    print(f"logs in {log_dir}", file=sys.stderr)
    empty = {"one_node": stats([], 0), "n_node": {}, "burst": {"reconcile_runs": 0}}
    events, polling = arms.get("events", empty), arms.get("polling", empty)
    floor = floor or {"1": stats([], 0)}
    one = events["one_node"]
    result = {
        "benchmark": "queued -> anchor label written",
        "command": command,
        "config": {
            "interval_s": args.interval,
            "poll_interval_s": args.poll_interval,
            "runner_poll_s": args.runner_poll,
            "write_interval_s": args.write_interval,
            "jobs_per_mode": args.jobs,
            "nodes": args.nodes,
            "gap_s": [args.gap_min, args.gap_max],
            "job_s": args.job_s,
            "seed": args.seed,
            "pool": POOL,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "floor": floor,
        "events": events,
        "polling": polling,
        "ratio_median_polling_over_events": ratio(polling["one_node"]["median_s"], one["median_s"]),
        "ratio_median_events_over_floor": ratio(one["median_s"], floor["1"]["median_s"]),
        "targets": {
            "one_node_median_le_2s": one["median_s"] is not None and one["median_s"] <= 2.0,
            "one_node_p95_le_5s": one["p95_s"] is not None and one["p95_s"] <= 5.0,
            "n_node_within_bound": all(e["within_bound"] for e in events["n_node"].values()),
            "burst_le_2_runs": events["burst"]["reconcile_runs"] <= 2,
        },
        "wall_s": round(time.monotonic() - started, 1),
        "smoke": args.smoke,
    }
    # the same keys as before for the one-node arms (tests and older readers)
    for arm in (events, polling):
        keys = ("latencies_s", "missing", "median_s", "mean_s", "max_s")
        arm.update({k: arm["one_node"][k] for k in keys})
    out = results_dir(args)
    (out / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.out.endswith("-partial"):
        print(json.dumps({k: result[k] for k in ("floor", "events", "polling")}, indent=1))
        return
    text = render(result, args)
    (out / f"{args.out}.md").write_text(text)
    print(text)


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    events, polling, floor = result["events"], result["polling"], result["floor"]
    lines = [
        "# Admission latency: queued -> anchor label written",
        "",
        f"Command: `{result['command']}`",
        "",
        "One run, one `prefect server start` (SQLite); reconcile served by `deployments/serve.py`. "
        f"Labels written at least {args.write_interval:g} s apart. "
        f"**events**: `--events` (the admission loop; interval floor {args.interval:g} s) fed by "
        f"`slurmgate webhook`; **polling**: a {args.poll_interval:g} s schedule, runner poll "
        f"{args.runner_poll:g} s, a process per run; **floor**: the core tick alone, no Prefect, "
        f"started when the job is queued. One-node jobs at random gaps of "
        f"{args.gap_min:g}-{args.gap_max:g} s (seed {args.seed}), {args.job_s:g} s long, "
        f"on an {POOL['a']}-runner pool.",
        "",
        "| arm | job | anchored | median s | p95 s | max s | bound s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]

    def row(arm: str, job: str, s: dict[str, Any], bound: str = "") -> str:
        got = f"{s['anchored']}/{s['anchored'] + s['missing']}"
        return (
            f"| {arm} | {job} | {got} | {s['median_s']} | {s['p95_s']} | {s['max_s']} | {bound} |"
        )

    lines.append(row("events", "1 node", events["one_node"], "median 2, p95 5"))
    for nodes, entry in events["n_node"].items():
        lines.append(row("events", f"{nodes} nodes", entry, f"{entry['bound_s']:g}"))
    lines.append(row("polling", "1 node", polling["one_node"]))
    for nodes, entry in floor.items():
        lines.append(row("floor", f"{nodes} node{'s' if nodes != '1' else ''}", entry))
    b = events["burst"]
    lines += [
        "",
        f"Burst: {b['jobs']} two-node jobs queued in {b['queued_in_s']} s made "
        f"**{b['reconcile_runs']} reconcile runs** (target at most 2); {b['admitted']} admitted "
        f"({b['fits']} fit). Runs of the deployment started over the whole events arm: "
        f"{events['flow_runs_started']} ({events['flow_runs_cancelled']} cancelled); "
        f"polling arm: {polling['flow_runs_started']}.",
        "",
        f"Median ratio polling / events: **{result['ratio_median_polling_over_events']}x**; "
        f"events / floor: **{result['ratio_median_events_over_floor']}x**.",
        "",
        "How to read it: the floor is the admission's own N + 1 writes, paced "
        f"{args.write_interval:g} s apart. A job queued while the loop is releasing a finished "
        "job's lease (one label DELETE per managed label, paced the same: about 4 s for a "
        "one-node lease) waits for that tick, which then admits it from its re-read; a job "
        "queued into a quiet fleet waits only for the floor and the loop's own overhead. "
        "The N-node jobs are queued into a quiet fleet, so they measure the latter.",
        "",
        "Targets: "
        + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in result["targets"].items()),
        "",
    ]
    if args.smoke:
        lines += [SMOKE_NOTE, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
