"""GitHub requests and primary quota per tick for an org of many repositories: events vs polling.

One organization scope over every repository (`all_repos`), one shared pool. Each arm gets a
fresh GitHub emulator with the same fleet and work, driven by the core's `reconcile_tick`
(`direct_steps`, a new client per tick with the file ETag cache, as the `reconcile` flow opens):

- **events**: jobs come from the relay's job-event store. The emulator's `workflow_job`
  deliveries go through the relay's own parsing (`webhook.parse_delivery`, `job_of`) into the
  store (`jobstore.JobEventStore`), in process: the HTTP hop and the Prefect post cost no
  GitHub requests. Every `--full-read-every`-th read polls, as in production.
- **polling** (the reference, today's path): every tick lists each repository's queued and
  in-progress runs and each active run's jobs, conditionally.

Work: `--runs` active runs over `--repos` repositories on `--runners` runners. All but
`--admit` runs are one in-progress job each (not slurmgate's: it holds a runner, not a lease);
then `--admit` managed jobs (`--nodes` each, 4 by default; each a new run in its own
repository) are queued and one busy tick admits them; then as many again, each admission
verified by its own read (the reference). After each busy tick, once its dispatch has settled,
the quietest tick after it reads what the busy tick read apart from the admissions, or less:
the busy tick's reads beyond it are the admissions' own. Idle ticks follow. On GitHub, as in
the emulator, a conditional request answered 304 costs no primary quota.

Run: .venv/bin/python benchmarks/bench_many_repos.py [--repos 100] [--runs 300] [--runners 1000]
Writes benchmarks/results/many_repos.json and .md. `--smoke`: 5 repositories, 12 runs, 40
runners, 4 admissions, a full read every 3; `--results-dir DIR` writes elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from options import add_output_flags, write_results

POOL = "a"
# GitHub asks for at least a second between mutating requests (its REST API best practices)
GITHUB_WRITE_PACE_S = 1.0
PACED_GRACES_S = (30.0, 90.0)  # the default orphan grace, and a longer one


def repo_names(count: int) -> list[str]:
    return [f"acme/repo-{i:03d}" for i in range(count)]


class StoreFeed:
    """The emulator's deliveries, parsed as the relay parses them, into the job-event store."""

    def __init__(self, emu: Any, store: Any) -> None:
        self.emu, self.store, self.deliveries = emu, store, 0
        emu.state.listeners.append(self.deliver)

    def deliver(self, action: str, job: Any) -> None:
        from slurmgate.github.webhook import job_of, parse_delivery

        body = json.dumps(self.emu.state.webhook_payload(action, job)).encode()
        delivery = parse_delivery(body)
        parsed = job_of(delivery)
        if parsed is not None:
            self.store.record(parsed, delivery.repository.full_name)
            self.deliveries += 1


async def one_tick(emu: Any, settings: Any, events: Any, alone: bool = False) -> dict[str, Any]:
    """One tick on a fresh client. `alone`: each admission verified by its own read, as before
    a batch of admissions shared one (a write pace at which no two fit one batch's budget)."""
    from dataclasses import replace

    from slurmgate.admission.batch_verify import BATCH_WRITE_BUDGET_S
    from slurmgate.admission.tick import reconcile_tick
    from slurmgate.controller.steps import direct_steps
    from slurmgate.github.factory import client_for_scope
    from slurmgate.github.scope import GitHubScope

    scope = GitHubScope(api_url=emu.url, org="acme", all_repos=True)
    emu.admin.reset_stats()
    started = time.perf_counter()
    async with client_for_scope(scope, emu.token) as client:
        steps = direct_steps(client, events=events)
        if alone:
            steps = replace(steps, write_interval_s=BATCH_WRITE_BUDGET_S + 1)
        report = await reconcile_tick(steps, settings)
    wall = time.perf_counter() - started
    stats = emu.admin.stats()
    return {
        "wall_s": round(wall, 3),
        "requests": stats["total"],
        "reads": stats["total"] - stats["writes"],
        "writes": stats["writes"],
        "not_modified": stats["not_modified"],
        "quota_used": stats["quota_used"],
        "admitted": report.admitted,
        "failures": len(report.failures),
    }


def run_arm(name: str, args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    from slurmgate.github.jobstore import JobEventStore
    from slurmgate.github.snapshot import EventReads
    from slurmgate.settings.admission import AdmissionSettings
    from slurmgate.testbed.emulator.testing import running_emulator

    os.environ["SLURMGATE_STATE_DIR"] = str(state_dir)
    settings = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True)
    repos = repo_names(args.repos)
    background = args.runs - args.admit
    with running_emulator(
        {POOL: args.runners}, repo=repos[0], repos=repos[1:], quota_limit=10_000_000
    ) as emu:
        events = None
        feed = None
        if name == "events":
            store = JobEventStore(state_dir / "job-events.sqlite")
            feed = StoreFeed(emu, store)
            events = EventReads(store, full_read_every=args.full_read_every)
        for i in range(background):  # in progress at once: any runner carries these labels
            emu.admin.add_job(["self-hosted", "Linux"], 36_000, repo=repos[i % len(repos)])
        warm = [asyncio.run(one_tick(emu, settings, events)) for _ in range(2)]
        busy = busy_tick(emu, settings, events, args, "m")
        settle = asyncio.run(one_tick(emu, settings, events))
        # the reference: as many jobs again, each verified by its own read, in the same arm
        busy_alone = busy_tick(emu, settings, events, args, "s", alone=True)
        settle_alone = asyncio.run(one_tick(emu, settings, events))
        idle = [asyncio.run(one_tick(emu, settings, events)) for _ in range(args.idle_ticks)]
        with emu.state.lock:
            active_runs = sum(
                1 for run in emu.state.runs.values() if emu.state.run_status(run)[0] != "completed"
            )
    return {
        "warm": warm,
        "busy": busy,
        "busy_alone": busy_alone,
        "settle_alone": settle_alone,
        "settle": settle,
        "idle": idle,
        "active_runs": active_runs,
        "deliveries": feed.deliveries if feed else 0,
    }


def busy_tick(
    emu: Any, settings: Any, events: Any, args: argparse.Namespace, tag: str, alone: bool = False
) -> dict[str, Any]:
    """Queue `--admit` managed jobs of `--nodes` nodes, each in a new run spread over the
    repositories; one tick admits them; wait until the emulator dispatched them."""
    repos = repo_names(args.repos)
    step = max(1, len(repos) // max(1, args.admit))
    for i in range(args.admit):
        labels = [
            "self-hosted",
            f"cluster:{POOL}",
            f"nodes:{args.nodes}",
            f"ci-job-1.000-{tag}{i}",
            "ci-attempt-1",
        ]
        emu.admin.add_job(labels, 36_000, repo=repos[(i * step) % len(repos)])
    tick = asyncio.run(one_tick(emu, settings, events, alone=alone))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the emulator dispatches admitted jobs to anchors
        with emu.state.lock:
            if not emu.state._queued:
                break
        time.sleep(0.05)
    return tick


def paced_tick(args: argparse.Namespace, grace_s: float) -> dict[str, Any]:
    """`--paced-admit` jobs of `--nodes` admitted by one tick whose client writes at GitHub's
    pace (one write a second) on `--runners` runners of one repository, with `grace_s` as the
    orphan grace; the reads beyond a quiet tick after it, per admission."""
    from slurmgate.admission.tick import reconcile_tick
    from slurmgate.controller.steps import direct_steps
    from slurmgate.github.client import GitHubClient
    from slurmgate.github.scope import GitHubScope
    from slurmgate.settings.admission import AdmissionSettings
    from slurmgate.testbed.emulator.testing import running_emulator

    settings = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True, orphan_grace_s=grace_s
    )

    async def tick(emu: Any) -> tuple[Any, dict[str, Any], float]:
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        async with GitHubClient(scope, emu.token, min_write_interval_s=GITHUB_WRITE_PACE_S) as c:
            emu.admin.reset_stats()
            started = time.perf_counter()
            report = await reconcile_tick(direct_steps(c), settings)
            return report, emu.admin.stats(), time.perf_counter() - started

    with running_emulator({POOL: args.runners}, quota_limit=10_000_000) as emu:
        for i in range(args.paced_admit):
            labels = ["self-hosted", f"cluster:{POOL}", f"nodes:{args.nodes}"]
            emu.admin.add_job([*labels, f"ci-job-1.000-p{i}", "ci-attempt-1"], 36_000)
        report, busy, wall = asyncio.run(tick(emu))
        _, quiet, _ = asyncio.run(tick(emu))
    reads = busy["total"] - busy["writes"]
    quiet_reads = quiet["total"] - quiet["writes"]
    return {
        "orphan_grace_s": grace_s,
        "admitted": report.admitted,
        "rolled_back": report.rolled_back,
        "failures": len(report.failures),
        "writes": busy["writes"],
        "reads": reads,
        "reads_per_admission_over_quiet": round((reads - quiet_reads) / max(1, report.admitted), 2),
        "wall_s": round(wall, 2),
    }


def summary(arm: dict[str, Any], admitted_nodes: int, nodes: int) -> dict[str, Any]:
    idle, busy, alone = arm["idle"], arm["busy"], arm["busy_alone"]
    quiet = [t for t in idle if t["reads"] == min(i["reads"] for i in idle)]
    admitted = max(1, busy["admitted"])
    return {
        "idle_requests_median": statistics.median(t["requests"] for t in idle),
        "idle_quota_median": statistics.median(t["quota_used"] for t in idle),
        "idle_requests_min": quiet[0]["requests"],
        "idle_quota_min": quiet[0]["quota_used"],
        "idle_requests_max": max(t["requests"] for t in idle),
        "idle_quota_max": max(t["quota_used"] for t in idle),
        "idle_requests_mean": round(statistics.mean(t["requests"] for t in idle), 2),
        "idle_quota_mean": round(statistics.mean(t["quota_used"] for t in idle), 2),
        "busy_requests": busy["requests"],
        "busy_quota": busy["quota_used"],
        "busy_admitted": busy["admitted"],
        "busy_writes": busy["writes"],
        "busy_writes_budget_n_plus_1": busy["admitted"] * (nodes + 1),
        "busy_reads": busy["reads"],
        # what the admissions add over the quietest tick after them (the same runs and runner
        # pages, or fewer), per admission: verification
        "busy_reads_per_admission_over_idle": round(
            (busy["reads"] - min(t["reads"] for t in (arm["settle"], *idle))) / admitted, 2
        ),
        # the reference: the same admissions, each verified by a read of its own
        "busy_alone_admitted": alone["admitted"],
        "busy_alone_reads_per_admission_over_idle": round(
            (alone["reads"] - min(t["reads"] for t in (arm["settle_alone"], *idle)))
            / max(1, alone["admitted"]),
            2,
        ),
        "busy_wall_s": busy["wall_s"],
        "idle_wall_s_median": round(statistics.median(t["wall_s"] for t in idle), 3),
        "admitted_nodes": admitted_nodes,
    }


def markdown(result: dict[str, Any]) -> str:
    ev, po = result["events"]["summary"], result["polling"]["summary"]
    size = result["size"]
    ratios = result["ratios"]
    lines = [
        "# Many repositories: job events vs polling",
        "",
        f"Org scope over every repository ({size['repos']} repositories, one pool of "
        f"{size['runners']} runners), {size['active_runs']} active runs; the busy tick admits "
        f"{size['admit']} jobs of {size['nodes']} nodes. Events: a full read every "
        f"{size['full_read_every']} reads. Reference: polling, today's path, same run.",
        "",
        "| per tick | events | polling (reference) | ratio polling / events |",
        "|---|---|---|---|",
        f"| idle: requests (median; max) | {ev['idle_requests_median']}; "
        f"{ev['idle_requests_max']} | {po['idle_requests_median']}; {po['idle_requests_max']} | "
        f"{ratios['idle_requests_polling_over_events']}x |",
        f"| idle: primary quota (median; max) | {ev['idle_quota_median']}; "
        f"{ev['idle_quota_max']} | {po['idle_quota_median']}; {po['idle_quota_max']} | |",
        f"| idle: requests, mean over {size['idle_ticks']} ticks (full reads included) | "
        f"{ev['idle_requests_mean']} | {po['idle_requests_mean']} | "
        f"{ratios['idle_mean_requests_polling_over_events']}x |",
        f"| busy: requests | {ev['busy_requests']} | {po['busy_requests']} | "
        f"{ratios['busy_requests_polling_over_events']}x |",
        f"| busy: primary quota | {ev['busy_quota']} | {po['busy_quota']} | |",
        f"| busy: admitted / label writes (N+1 budget) | {ev['busy_admitted']} / "
        f"{ev['busy_writes']} ({ev['busy_writes_budget_n_plus_1']}) | {po['busy_admitted']} / "
        f"{po['busy_writes']} ({po['busy_writes_budget_n_plus_1']}) | |",
        f"| busy: reads per admission over the quietest tick after it | "
        f"{ev['busy_reads_per_admission_over_idle']} | "
        f"{po['busy_reads_per_admission_over_idle']} | |",
        f"| reference: the same busy tick, each admission verified by its own read | "
        f"{ev['busy_alone_reads_per_admission_over_idle']} | "
        f"{po['busy_alone_reads_per_admission_over_idle']} | |",
        f"| wall time: busy; idle median (s) | {ev['busy_wall_s']}; {ev['idle_wall_s_median']} | "
        f"{po['busy_wall_s']}; {po['idle_wall_s_median']} | |",
        "",
        f"Targets: an idle tick with events costs 0 primary quota (median "
        f"{ev['idle_quota_median']}; the full read every {size['full_read_every']} reads is "
        f"the most, {ev['idle_quota_max']}: it pays for the runs that changed since the "
        f"previous full read, which the events already told) and at most 20 requests (median "
        f"{ev['idle_requests_median']}: the runner list's pages, all 304s; the full read costs "
        f"{ev['idle_requests_max']}, as much as a polling tick); a busy tick reads at most 2 "
        f"per admission beyond the quietest tick after it "
        f"({ev['busy_reads_per_admission_over_idle']}: one fresh read of the runner list "
        f"verifies the tick's admissions together; verified alone, each reads its "
        f"{size['nodes']} runners or the list's pages, whichever are fewer: "
        f"{ev['busy_alone_reads_per_admission_over_idle']}).",
        f"Relay deliveries stored in the events arm: {result['events']['deliveries']}.",
        "",
    ]
    paced = result.get("paced") or []
    if paced:
        lines += [
            f"At GitHub's write pace (one write a second), {size['paced_admit']} jobs of "
            f"{size['nodes']} nodes on {size['runners']} runners, one tick; a batch's writes must "
            "fit in half the anchor window (20 s, or two thirds of a longer orphan grace):",
            "",
            "| orphan grace (s) | admitted / rolled back | writes | reads per admission | "
            "tick wall time (s) |",
            "|---|---|---|---|---|",
            *(
                f"| {p['orphan_grace_s']:.0f} | {p['admitted']} / {p['rolled_back']} | "
                f"{p['writes']} | {p['reads_per_admission_over_quiet']} | {p['wall_s']} |"
                for p in paced
            ),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repos", type=int, default=100)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--runners", type=int, default=1000)
    parser.add_argument("--admit", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=4, help="nodes per admitted job")
    parser.add_argument(
        "--paced-admit",
        type=int,
        default=6,
        help="jobs admitted at GitHub's write pace, once per orphan grace (0: skip; ~1 s a write)",
    )
    parser.add_argument("--full-read-every", type=int, default=10)
    parser.add_argument("--idle-ticks", type=int, default=10)
    add_output_flags(parser, "5 repositories, 12 runs, 40 runners, 4 admissions")
    args = parser.parse_args()
    if args.smoke:
        args.repos, args.runs, args.runners = 5, 12, 40
        args.admit, args.full_read_every, args.idle_ticks = 4, 3, 3
        args.paced_admit = 0  # a minute of paced writes is no smoke test
    if args.nodes < 1:
        parser.error("--nodes must be 1 or more")
    needed = args.runs - args.admit + 2 * args.admit * args.nodes  # both busy ticks' leases
    if args.runs <= args.admit or args.runners < needed:
        parser.error(f"need --runs > --admit and --runners >= {needed} for every run and lease")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    arms: dict[str, Any] = {}
    for name in ("polling", "events"):
        with tempfile.TemporaryDirectory(prefix=f"slurmgate-bench-{name}-") as state:
            arms[name] = run_arm(name, args, Path(state))
    admitted_nodes = args.nodes * args.admit
    for arm in arms.values():
        arm["summary"] = summary(arm, admitted_nodes, args.nodes)
    ev, po = arms["events"]["summary"], arms["polling"]["summary"]
    result: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "size": {
            "repos": args.repos,
            "runs": args.runs,
            "active_runs": arms["events"]["active_runs"],
            "runners": args.runners,
            "admit": args.admit,
            "nodes": args.nodes,
            "paced_admit": args.paced_admit,
            "full_read_every": args.full_read_every,
            "idle_ticks": args.idle_ticks,
        },
        "events": arms["events"],
        "polling": arms["polling"],
        "ratios": {
            "idle_requests_polling_over_events": round(
                po["idle_requests_median"] / max(1, ev["idle_requests_median"]), 1
            ),
            "idle_mean_requests_polling_over_events": round(
                po["idle_requests_mean"] / max(1, ev["idle_requests_mean"]), 1
            ),
            "busy_requests_polling_over_events": round(
                po["busy_requests"] / max(1, ev["busy_requests"]), 1
            ),
        },
        "paced": [paced_tick(args, grace) for grace in PACED_GRACES_S] if args.paced_admit else [],
        "smoke": args.smoke,
    }
    write_results(args, "many_repos", result, markdown(result))


if __name__ == "__main__":
    main()
