"""End to end: emulator webhooks -> relay -> Prefect events -> deployment trigger -> reconcile.

The emulator sends real signed `workflow_job` deliveries when its jobs change state; reconcile is
served (`serve()` in a subprocess, as `deployments/serve.py` does) against the session's Prefect
server with the trigger of `deployments/triggers.py` and no schedule, so every run it makes comes
from an event.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from relaykit import SECRET, job_labels, runs_of, stop_processes, wait_until

from slurmgate.testbed.prefect_server import deployment_ready

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

pytestmark = pytest.mark.serial  # each test asserts on the debounce window's timing


@pytest.fixture
def serve_reconcile(prefect_api: str, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """`serve_reconcile(emu)` serves reconcile with the event trigger; returns its name."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(emu: Any, within_s: float = 10.0) -> str:
        name = f"events-{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "PREFECT_RUNNER_POLL_FREQUENCY": "1",
            "GITHUB_TOKEN": emu.token,
            "PRIORITY_SCHEDULER_ENABLED": "true",
            "NODE_SLOT_SCHEDULER_ENABLED": "true",
            "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
            "SLURMGATE_ORPHAN_GRACE_S": "0",
            "SLURMGATE_STATE_DIR": str(tmp_path / "state"),
        }
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        serve = [
            sys.executable,
            "-m",
            "slurmgate.deployments.serve",
            "--only",
            "reconcile",
            "--name",
            name,
        ]
        serve += ["--interval", "0", "--api-url", emu.url, "--repo", emu.repo]
        proc = subprocess.Popen(
            [*serve, *(["--triggers", str(within_s)] if within_s >= 0 else [])],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        triggers = 2 if within_s >= 0 else 0
        ready = lambda: deployment_ready(prefect_api, f"reconcile/{name}", triggers)  # noqa: E731
        wait_until(lambda: ready() or proc.poll() is not None, 60, "serve")
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-3000:]
        return name

    yield start
    stop_processes(procs)


def test_burst_of_50_queued_jobs_makes_one_or_two_reconcile_runs(
    relay_factory, serve_reconcile, prefect_api
) -> None:
    from slurmgate.testbed.emulator.testing import running_emulator

    relay = relay_factory()
    with running_emulator({"a": 4}, webhook_urls=[relay.url], webhook_secret=SECRET) as emu:
        name = serve_reconcile(emu)
        assert runs_of(prefect_api, name) == []
        started = time.monotonic()
        ids = [emu.admin.add_job(job_labels(f"b{i}", 2), duration_s=600)["id"] for i in range(50)]
        burst_s = time.monotonic() - started
        wait_until(lambda: relay.stats["posted"] >= 50, 30, "50 queued events posted")

        # reconcile ran because of the events and admitted what fits: 4 runners, 2 nodes each
        def admitted() -> list[int]:
            jobs = {j["id"]: j for j in emu.admin.dump()["jobs"]}
            return [i for i in ids if jobs[i]["status"] == "in_progress"]

        running = wait_until(lambda: len(admitted()) == 2 and admitted(), 90, "two admissions")
        assert running == ids[:2], "admission order is queue order among equal jobs"
        # let the trailing run's delay pass; no further run may appear
        time.sleep(max(0.0, 20.0 - (time.monotonic() - started)))
        wait_until(lambda: all(r.final for r in runs_of(prefect_api, name)), 60, "runs to finish")
        runs = runs_of(prefect_api, name)
        completed = [r for r in runs if r.state_type == "COMPLETED"]
        assert 1 <= len(runs) <= 2, f"{len(runs)} runs for a burst of 50 (in {burst_s:.1f} s)"
        assert completed, [r.state_name for r in runs]
        assert relay.stats["duplicates"] == 0 and relay.stats["unauthorized"] == 0


def test_prefect_yaml_carries_the_same_trigger() -> None:
    from slurmgate.deployments.triggers import reconcile_trigger_specs, reconcile_triggers

    config = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    reconcile = next(d for d in config["deployments"] if d["name"] == "reconcile")
    assert reconcile["triggers"] == reconcile_trigger_specs()
    # the yaml entries are valid Prefect deployment triggers, the ones triggers.py builds
    from prefect.events import DeploymentEventTrigger

    parsed = [
        DeploymentEventTrigger(**{k: v for k, v in entry.items() if k != "type"})
        for entry in reconcile["triggers"]
    ]
    assert parsed == reconcile_triggers()
    assert [t.schedule_after.total_seconds() for t in parsed] == [0, 25]  # leading, trailing
    # any interval schedule stays as the safety net
    assert reconcile["schedules"][0]["interval"] == 30


def test_a_job_queued_inside_the_window_is_admitted_by_the_trailing_run(
    relay_factory, serve_reconcile, prefect_api
) -> None:
    """The leading run has read the fleet already; the delayed run picks the late job up."""
    from slurmgate.testbed.emulator.testing import running_emulator

    def anchored(emu: Any, token: str) -> bool:
        with emu.state.lock:
            return any(f"ci-job-1.000-{token}" in r.folded() for r in emu.state.runners.values())

    relay = relay_factory()
    # A 45 s window: the leading run is a fresh flow process (Prefect's imports alone take ~7 s
    # on 2 busy cores, more on a fresh machine whose bytecode is not compiled yet) and must
    # admit the early job while the window is still open; 30 s was too short there once.
    within = 45.0
    trailing = within + 15  # scheduled; the runner's 10 s prefetch starts it ~5 s after that
    with running_emulator({"a": 4}, webhook_urls=[relay.url], webhook_secret=SECRET) as emu:
        name = serve_reconcile(emu, within_s=within)
        first_at = time.monotonic()
        emu.admin.add_job(job_labels("early", 1), duration_s=600)
        try:
            wait_until(lambda: anchored(emu, "early"), within - 3, "the leading run to admit")
        except AssertionError:
            runs = [(r.name, r.state_name, r.start_time) for r in runs_of(prefect_api, name)]
            raise AssertionError(f"leading run too slow: {runs}; relay: {relay.stats}") from None
        late_at = time.monotonic()
        assert late_at - first_at < within - 1, "the late job must land inside the window"
        emu.admin.add_job(job_labels("late", 1), duration_s=600)
        wait_until(lambda: relay.stats["posted"] >= 2, 10, "the late job's event")
        time.sleep(1.0)
        assert not anchored(emu, "late"), "a run outside the debounce admitted the late job"
        try:
            wait_until(lambda: anchored(emu, "late"), trailing + 20, "the trailing run to admit")
        except AssertionError:
            runs = [
                (r.name, r.state_name, r.expected_start_time, r.start_time)
                for r in runs_of(prefect_api, name)
            ]
            raise AssertionError(f"runs: {runs}; relay: {relay.stats}") from None
        assert time.monotonic() - first_at >= within  # the delayed run, not a new one
        starts = sorted(
            r.start_time for r in runs_of(prefect_api, name) if r.start_time is not None
        )
        assert len(starts) == 2, starts
