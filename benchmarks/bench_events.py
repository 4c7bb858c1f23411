"""Admission latency: a job queued -> its anchor label written, with events vs with polling.

Both modes run in one process against one real Prefect server (`prefect server start` on a free
loopback port, SQLite, in a temporary PREFECT_HOME; the test harness runs no scheduler) and a
fresh GitHub emulator each, with `reconcile` served by `serve()` in a subprocess:

- **events**: the emulator sends signed `workflow_job` webhooks to `slurmgate webhook`'s relay,
  which posts Prefect events; the debounced trigger (deployments/triggers.py) runs reconcile.
  The schedule safety net is on too, as in production.
- **polling**: the same deployment with only its interval schedule.

Jobs (1 node each, 3 s long, on an 8-runner pool) arrive at random gaps (seeded). Latency is
measured from the emulator accepting the job to the first moment its `ci-job-*` label is on a
runner (sampled every 20 ms from the emulator's state). Both modes pay the served runner's poll
(`PREFECT_RUNNER_POLL_FREQUENCY`, Prefect's default 10 s) between a run being created and it
starting.

Run: .venv/bin/python benchmarks/bench_events.py [--interval 30] [--jobs 8] [--runner-poll 10]
Writes benchmarks/results/events.json and .md (`--out NAME` for another stem, `--results-dir DIR`
for another directory). About 4 minutes. `--smoke` shrinks the waits (schedule 12 s, debounce 2 s,
runner poll 1 s, 3 jobs per mode at 0.5-2 s gaps): about a minute and a half, most of it starting
the Prefect server and the two served runners.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from options import SMOKE_NOTE, add_output_flags, results_dir

from slurmgate.testbed.prefect_server import (
    deployment_ready,
    deployment_runs,
    running_prefect_server,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SECRET = "bench-webhook-secret"
POOL = {"a": 8}


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

    def __enter__(self) -> AnchorWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_mode(mode: str, api_url: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from slurmgate.github.webhook import RelayServer, RelaySettings
    from slurmgate.testbed.emulator.testing import running_emulator

    relay = None
    hooks: dict[str, Any] = {}
    if mode == "events":
        relay = RelayServer(RelaySettings(secret=SECRET, prefect_api_url=api_url)).start()
        hooks = {"webhook_urls": [relay.url], "webhook_secret": SECRET}
    rng = random.Random(args.seed)
    name = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
    latencies: list[float] = []
    try:
        with running_emulator(POOL, **hooks) as emu:
            env = {
                **os.environ,
                "PREFECT_API_URL": api_url,
                "PREFECT_RUNNER_POLL_FREQUENCY": str(args.runner_poll),
                "GITHUB_TOKEN": emu.token,
                "PRIORITY_SCHEDULER_ENABLED": "true",
                "NODE_SLOT_SCHEDULER_ENABLED": "true",
                "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
                "SLURMGATE_STATE_DIR": str(log_dir / f"state-{mode}"),
            }
            within = args.within if mode == "events" else -1
            cmd = [sys.executable, "deployments/serve.py", "--only", "reconcile", "--name", name]
            cmd += ["--interval", str(args.interval), "--api-url", emu.url, "--repo", emu.repo]
            cmd += ["--triggers", str(within)] if within >= 0 else []
            with open(log_dir / f"{name}.log", "wb") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
            try:
                deadline = time.monotonic() + 90
                while not deployment_ready(
                    api_url, f"reconcile/{name}", 2 if mode == "events" else 0
                ):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"serve did not start; see {log_dir / name}.log")
                    time.sleep(0.5)
                # let the schedule's first (immediate) run pass, so jobs meet a steady state
                time.sleep(args.runner_poll + args.settle)
                with AnchorWatch(emu.state) as watch:
                    for i in range(args.jobs):
                        time.sleep(rng.uniform(args.gap_min, args.gap_max))
                        token = f"{mode[0]}{i}x{uuid.uuid4().hex[:6]}"
                        labels = ["self-hosted", "cluster:a", "nodes:1"]
                        labels += [f"ci-job-1.000-{token}", "ci-attempt-1"]
                        emu.admin.add_job(labels, duration_s=3)
                        watch.queued[token] = time.monotonic()
                    limit = time.monotonic() + args.interval + 4 * args.runner_poll + 30
                    while len(watch.anchored) < len(watch.queued) and time.monotonic() < limit:
                        time.sleep(0.2)
                    for token, at in watch.queued.items():
                        if token in watch.anchored:
                            latencies.append(watch.anchored[token] - at)
                    missing = len(watch.queued) - len(latencies)
                runs = deployment_runs(api_url, f"reconcile/{name}")
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    finally:
        if relay is not None:
            relay.stop()
    return {
        "mode": mode,
        "latencies_s": [round(x, 3) for x in latencies],
        "missing": missing,
        "median_s": round(statistics.median(latencies), 3) if latencies else None,
        "mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "max_s": round(max(latencies), 3) if latencies else None,
        "flow_runs_started": sum(1 for r in runs if r.start_time is not None),
        "flow_runs_cancelled": sum(1 for r in runs if r.state_type == "CANCELLED"),
        "relay": dict(relay.stats) if relay is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=30.0, help="reconcile schedule, s")
    parser.add_argument("--within", type=float, default=10.0, help="trigger debounce window, s")
    parser.add_argument("--runner-poll", type=float, default=10.0, help="served runner poll, s")
    parser.add_argument("--jobs", type=int, default=8, help="jobs per mode")
    parser.add_argument("--gap-min", type=float, default=4.0)
    parser.add_argument("--gap-max", type=float, default=16.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="events", help="results file stem under results/")
    add_output_flags(
        parser, "schedule 12 s, debounce 2 s, runner poll 1 s, 3 jobs per mode at 0.5-2 s gaps"
    )
    args = parser.parse_args()
    args.settle = 5.0  # after the runner's poll, so the schedule's first run has passed
    if args.smoke:
        args.interval, args.within = min(args.interval, 12.0), min(args.within, 2.0)
        args.runner_poll, args.jobs = min(args.runner_poll, 1.0), min(args.jobs, 3)
        args.gap_min, args.gap_max = min(args.gap_min, 0.5), min(args.gap_max, 2.0)
        args.settle = 2.0

    import tempfile

    log_dir = Path(tempfile.mkdtemp(prefix="slurmgate-bench-events-"))
    os.environ["PREFECT_HOME"] = str(log_dir / "prefect-home")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    started = time.monotonic()
    with (
        running_prefect_server(log_dir, log=log_dir / "prefect-server.log") as server,
        temporary_settings({PREFECT_API_URL: server.api_url}),
    ):
        results = [run_mode(mode, server.api_url, args, log_dir) for mode in ("events", "polling")]
    events, polling = results
    ratio = (
        round(polling["median_s"] / events["median_s"], 2)
        if events["median_s"] and polling["median_s"]
        else None
    )
    result = {
        "benchmark": "queued -> anchor label written",
        "config": {
            "interval_s": args.interval,
            "within_s": args.within,
            "runner_poll_s": args.runner_poll,
            "jobs_per_mode": args.jobs,
            "gap_s": [args.gap_min, args.gap_max],
            "seed": args.seed,
            "pool": POOL,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "events": events,
        "polling": polling,
        "ratio_median_polling_over_events": ratio,
        "wall_s": round(time.monotonic() - started, 1),
        "smoke": args.smoke,
    }
    out = results_dir(args)
    (out / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Admission latency: queued -> anchor label written",
        "",
        "One run, one `prefect server start` (SQLite); reconcile served by "
        "`deployments/serve.py`, "
        f"runner poll {args.runner_poll:g} s; schedule interval {args.interval:g} s in both modes; "
        f"trigger debounce {args.within:g} s; {args.jobs} one-node jobs per mode at random gaps "
        f"of {args.gap_min:g}-{args.gap_max:g} s (seed {args.seed}).",
        "",
        "| mode | jobs anchored | median s | mean s | max s | reconcile runs started (cancelled) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {len(r['latencies_s'])}/{args.jobs} | {r['median_s']} | "
            f"{r['mean_s']} | {r['max_s']} | {r['flow_runs_started']} "
            f"({r['flow_runs_cancelled']}) |"
        )
    lines += ["", f"Median ratio polling / events: **{ratio}x**.", ""]
    if args.smoke:
        lines += [SMOKE_NOTE, ""]
    (out / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
