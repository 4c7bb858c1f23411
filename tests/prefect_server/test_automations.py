"""The shipped heartbeat automation on a real server: created once, and it crashes a silent run."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from slurmgate.deployments import automations as automations_module

from .conftest import REPO, PrefectServer

pytestmark = [pytest.mark.prefect_server, pytest.mark.serial]


def automations_named(server: PrefectServer, name: str) -> list[dict[str, Any]]:
    response = server.api.post("/automations/filter", json={"limit": 100})
    response.raise_for_status()
    return [a for a in response.json() if a["name"] == name]


def run_script(server: PrefectServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.deployments.automations", *args],
        capture_output=True,
        text=True,
        env=server.env(),
        cwd=str(REPO),
        timeout=60,
        check=False,
    )


def test_script_creates_one_automation_and_rejects_a_window_shorter_than_the_heartbeat(
    prefect_server: PrefectServer,
) -> None:
    name = "slurmgate-crash-silent-flow-runs"
    for _ in range(2):  # idempotent: a second deploy updates, never duplicates
        done = run_script(prefect_server, "--within", "150", "--heartbeat", "30")
        assert done.returncode == 0, done.stdout + done.stderr
    (automation,) = automations_named(prefect_server, name)
    trigger = automation["trigger"]
    assert trigger["posture"] == "Proactive" and trigger["within"] == 150.0
    assert trigger["after"] == ["prefect.flow-run.heartbeat"]
    assert "prefect.flow-run.Completed" in trigger["expect"]
    assert trigger["for_each"] == ["prefect.resource.id"]
    assert automation["actions"][0]["type"] == "change-flow-run-state"
    assert automation["actions"][0]["state"] == "CRASHED"

    bad = run_script(prefect_server, "--within", "20", "--heartbeat", "30")
    assert bad.returncode == 2
    assert "within_s=20 must be longer than the heartbeat interval (30 s)" in bad.stderr
    assert "Traceback" not in bad.stderr
    default = run_script(prefect_server, "--heartbeat", "180")
    assert default.returncode == 0, default.stderr
    (automation,) = automations_named(prefect_server, name)
    assert automation["trigger"]["within"] == 600.0  # 3 heartbeats + 60 s


def heartbeat(server: PrefectServer, run_id: str) -> None:
    event = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "prefect.flow-run.heartbeat",
        "resource": {"prefect.resource.id": f"prefect.flow-run.{run_id}"},
        "payload": {},
    }
    response = server.api.post("/events", json=[event])
    assert response.status_code == 204, response.text


def running_flow_run(server: PrefectServer, flow_id: str, name: str) -> str:
    run = server.api.post("/flow_runs/", json={"flow_id": flow_id, "name": name}).json()
    state = server.api.post(
        f"/flow_runs/{run['id']}/set_state", json={"state": {"type": "RUNNING"}, "force": True}
    )
    assert state.status_code in (200, 201), state.text
    return str(run["id"])


def test_a_run_whose_heartbeats_stop_is_marked_crashed_and_a_beating_one_is_not(
    prefect_server: PrefectServer,
) -> None:
    """The shipped automation with a 10 s window (the shortest Prefect allows), on runs whose
    heartbeats the test sends: one goes silent after one beat (a SIGKILLed process), one keeps
    beating every 2 s."""
    import asyncio

    automations = automations_module
    name = f"crash-silent-test-{uuid.uuid4().hex[:6]}"
    with prefect_server.client_settings():
        automation_id = asyncio.run(automations.aensure_heartbeat_automation(10, 2, name))
    try:
        flow = prefect_server.api.post("/flows/", json={"name": "heartbeat-check"}).json()
        silent = running_flow_run(prefect_server, flow["id"], "silent")
        alive = running_flow_run(prefect_server, flow["id"], "alive")
        heartbeat(prefect_server, silent)
        heartbeat(prefect_server, alive)
        deadline = time.monotonic() + 45
        while prefect_server.state(silent) != "CRASHED":
            assert time.monotonic() < deadline, prefect_server.run(silent)["state"]
            heartbeat(prefect_server, alive)
            time.sleep(2)
        crashed = prefect_server.run(silent)["state"]
        assert "no heartbeat for 10 s" in crashed["message"], crashed
        assert prefect_server.state(alive) == "RUNNING"
    finally:
        prefect_server.api.delete(f"/automations/{automation_id}")
