"""End to end: emulator webhooks -> relay -> Prefect events -> the admission loop of
`serve.py --events` -> reconcile runs in the served process.

Served with `--interval 0` (no interval floor, no schedule) and a 60 s runner poll, so every
admission here comes from an event and from the loop, not from the schedule or the runner. The
last test kills the served process mid-tick and waits for the heartbeat automation (about 70 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relaykit import SECRET, job_labels, runs_of, stop_processes, wait_for_events, wait_until

from slurmgate.testbed.prefect_server import FlowRunSummary, deployment_ready, deployment_runs

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.serial  # the loop's latency and the burst's coalescing are timed


def anchored(emu: Any, token: str) -> bool:
    with emu.state.lock:
        return any(f"ci-job-1.000-{token}" in r.folded() for r in emu.state.runners.values())


@pytest.fixture
def serve_loop(prefect_api: str, tmp_path: Path) -> Iterator[Any]:
    """`serve_loop(emu)` serves reconcile with `--events --interval 0`; returns its name once
    its start tick has finished (the event stream is connected before it). `serve_loop.procs`
    are the served processes."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(emu: Any, heartbeat_s: int | None = None) -> str:
        name = f"loop-{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "PREFECT_RUNNER_POLL_FREQUENCY": "60",
            "GITHUB_TOKEN": emu.token,
            "PRIORITY_SCHEDULER_ENABLED": "true",
            "NODE_SLOT_SCHEDULER_ENABLED": "true",
            "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
            "SLURMGATE_STATE_DIR": str(tmp_path / "state"),
        }
        if heartbeat_s is not None:
            env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(heartbeat_s)
        cmd = [
            sys.executable,
            "-m",
            "slurmgate.deployments.serve",
            "--only",
            "reconcile",
            "--name",
            name,
        ]
        cmd += ["--events", "--interval", "0", "--api-url", emu.url, "--repo", emu.repo]
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)

        def started() -> bool:
            if proc.poll() is not None:
                raise AssertionError((tmp_path / f"{name}.log").read_text()[-3000:])
            if not deployment_ready(prefect_api, f"reconcile/{name}"):
                return False
            return any(r.final for r in deployment_runs(prefect_api, f"reconcile/{name}"))

        wait_until(started, 90, "serve and its start tick")
        return name

    start.procs = procs  # type: ignore[attr-defined]
    yield start
    stop_processes(procs)


def test_a_queued_job_is_admitted_by_the_loop_without_a_schedule(
    relay_factory, serve_loop, prefect_api
) -> None:
    from slurmgate.testbed.emulator.testing import running_emulator

    relay = relay_factory()
    with running_emulator({"a": 4}, webhook_urls=[relay.url], webhook_secret=SECRET) as emu:
        name = serve_loop(emu)
        before = len(runs_of(prefect_api, name))
        emu.admin.add_job(job_labels("now", 1), duration_s=600)
        # no schedule and a 60 s runner poll: only the loop, woken by the event, admits this
        wait_until(lambda: anchored(emu, "now"), 30, "the loop to admit the queued job")
        runs = runs_of(prefect_api, name)
        assert len(runs) == before + 1, [r.name for r in runs]
        assert all(r.state_type != "CANCELLED" for r in runs)


def test_burst_of_50_queued_jobs_makes_at_most_two_loop_ticks(
    relay_factory, serve_loop, prefect_api
) -> None:
    from slurmgate.testbed.emulator.testing import running_emulator

    relay = relay_factory()
    with running_emulator({"a": 4}, webhook_urls=[relay.url], webhook_secret=SECRET) as emu:
        name = serve_loop(emu)
        before = len(runs_of(prefect_api, name))
        ids = [emu.admin.add_job(job_labels(f"b{i}", 2), duration_s=600)["id"] for i in range(50)]
        wait_until(lambda: relay.stats["posted"] >= 50, 30, "50 queued events posted")

        def admitted() -> list[int]:
            jobs = {j["id"]: j for j in emu.admin.dump()["jobs"]}
            return [i for i in ids if jobs[i]["status"] == "in_progress"]

        running = wait_until(lambda: len(admitted()) == 2 and admitted(), 30, "two admissions")
        assert running == ids[:2], "admission order is queue order among equal jobs"
        time.sleep(5.0)  # past the loop's quiet time and max delay: no further tick may start
        wait_until(lambda: all(r.final for r in runs_of(prefect_api, name)), 30, "runs to end")
        runs = runs_of(prefect_api, name)
        burst_runs = len(runs) - before
        assert 1 <= burst_runs <= 2, f"{burst_runs} reconcile runs for a burst of 50"
        assert all(r.state_type == "COMPLETED" for r in runs), [r.state_name for r in runs]


def test_a_tick_of_a_killed_loop_process_is_marked_crashed(
    relay_factory, serve_loop, prefect_api
) -> None:
    """SIGKILL the served process mid-tick: the tick, a run of the deployment executed in that
    process, stops heartbeating, and the shipped heartbeat automation marks it Crashed."""
    import asyncio

    from slurmgate.deployments import automations
    from slurmgate.testbed.emulator.testing import running_emulator

    name = f"crash-loop-test-{uuid.uuid4().hex[:6]}"
    # Prefect's shortest heartbeat is 30 s; the window must be longer
    automation_id = asyncio.run(automations.aensure_heartbeat_automation(40, 30, name))
    relay = relay_factory()
    try:
        with running_emulator({"a": 4}, webhook_urls=[relay.url], webhook_secret=SECRET) as emu:
            deployment = serve_loop(emu, heartbeat_s=30)
            proc = serve_loop.procs[-1]  # type: ignore[attr-defined]
            # the next tick's runner read hangs, so the tick is mid-run when the process dies
            emu.admin.fault("latency", method="GET", path="*/actions/runners*", ms=60000)
            emu.admin.add_job(job_labels("hang", 1), duration_s=600)

            def running() -> list[FlowRunSummary]:
                return [r for r in runs_of(prefect_api, deployment) if r.state_type == "RUNNING"]

            (tick,) = wait_until(running, 30, "the woken tick to run")
            # The automation counts from a heartbeat: kill only once the server has one (on a
            # slow machine the first can still be on its way when the run shows RUNNING).
            beats = {"event": {"name": ["prefect.flow-run.heartbeat"]}}
            beats["resource"] = {"id": [f"prefect.flow-run.{tick.id}"]}
            assert wait_for_events(prefect_api, 1, 60, **beats), "the tick sent no heartbeat"
            proc.kill()
            proc.wait(timeout=10)

            def crashed() -> bool:
                runs = {r.name: r for r in runs_of(prefect_api, deployment)}
                return runs[tick.name].state_type == "CRASHED"

            # 40 s of silence, then the server's proactive check: about 45 s here; a fresh
            # machine's run once took over 90 s, so the bound says "it happens", not how fast
            wait_until(crashed, 180, "the heartbeat automation to mark the tick Crashed")
            emu.admin.clear_faults()
    finally:
        from prefect import get_client

        async def delete() -> None:
            async with get_client() as client:
                await client.delete_automation(automation_id)

        asyncio.run(delete())
