"""`prefect deploy --all` with deployments/prefect.yaml on its own server, as operators run it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import (
    REPO,
    TOKEN,
    PrefectServer,
    running_prefect_server,
    save_default_blocks,
    stop_group,
)

pytestmark = pytest.mark.prefect_server

AUTH_PASSWORD = "s3cret-AUTH-pass"


@pytest.fixture(scope="module")
def deploy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A server of its own (deploying replaces the served deployments of the same names), with
    basic auth on, as a server that others can reach should run."""
    home = tmp_path_factory.mktemp("deploy-server")
    with running_prefect_server(home, auth=f"ops:{AUTH_PASSWORD}") as server:
        yield server


def venv_env(server: PrefectServer, **extra: str) -> dict[str, str]:
    """A client environment from the activated venv (the build step runs its `python`)."""
    venv_bin = str(Path(sys.executable).parent)
    return server.env(PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}", **extra)


def run_script_venv(server: PrefectServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.deployments.automations", *args],
        capture_output=True,
        text=True,
        env=venv_env(server),
        cwd=str(REPO),
        timeout=60,
        check=False,
    )


def prefect_cli(server: PrefectServer, *args: str) -> subprocess.CompletedProcess[str]:
    """`prefect ...` as an operator runs it from the activated venv."""
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        capture_output=True,
        text=True,
        env=venv_env(server),
        cwd=str(REPO),
        timeout=120,
        check=False,
    )


def test_deploy_all_creates_the_three_deployments_and_the_heartbeat_automation(
    deploy_server: PrefectServer,
) -> None:
    pool = prefect_cli(deploy_server, "work-pool", "create", "slurmgate", "--type", "process")
    assert pool.returncode == 0, pool.stdout + pool.stderr
    for _ in range(2):  # deploying again updates in place
        deploy = prefect_cli(
            deploy_server,
            "--no-prompt",
            "deploy",
            "--all",
            "--prefect-file",
            "deployments/prefect.yaml",
        )
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]

    api = deploy_server.api
    reconcile = api.get("/deployments/name/reconcile/reconcile").json()
    assert reconcile["work_pool_name"] == "slurmgate"
    assert reconcile["global_concurrency_limit"]["limit"] == 1
    assert reconcile["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert reconcile["schedules"][0]["schedule"]["interval"] == 30.0
    release = api.get("/deployments/name/release-lease/release-lease").json()
    assert "job_id" in release["parameter_openapi_schema"]["required"]
    allocation = api.get("/deployments/name/allocation/allocation").json()
    spec_schema = allocation["parameter_openapi_schema"]["properties"]["spec"]
    assert "$ref" in str(spec_schema) or "allOf" in str(spec_schema)  # a typed form, not JSON

    automations = api.post("/automations/filter", json={"limit": 100}).json()
    named = [a for a in automations if a["name"] == "slurmgate-crash-silent-flow-runs"]
    assert len(named) == 1, [a["name"] for a in automations]
    assert named[0]["trigger"]["within"] == 600.0


def test_an_auth_string_keeps_anonymous_callers_out(deploy_server: PrefectServer) -> None:
    """PREFECT_SERVER_API_AUTH_STRING on the server: every API call needs the credentials
    (`include_secrets=true` would otherwise hand block secrets to anyone who can connect)."""
    import httpx

    denied = httpx.post(f"{deploy_server.api_url}/block_documents/filter", json={}, timeout=10)
    assert denied.status_code == 401, denied.text
    wrong = httpx.post(
        f"{deploy_server.api_url}/deployments/filter", json={}, auth=("ops", "guess"), timeout=10
    )
    assert wrong.status_code == 401
    allowed = deploy_server.api.post("/deployments/filter", json={})
    assert allowed.status_code == 200


def flow_run_processes(run_id: str) -> list[int]:
    """Pids whose environment says they execute flow run `run_id` (the worker sets it)."""
    needle = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                pids.append(int(entry.name))
    return pids


def heartbeats_seen(server: PrefectServer, run_id: str) -> int:
    response = server.api.post(
        "/events/filter",
        json={
            "filter": {
                "event": {"name": ["prefect.flow-run.heartbeat"]},
                "resource": {"id": [f"prefect.flow-run.{run_id}"]},
            },
            "limit": 10,
        },
    )
    response.raise_for_status()
    return len(response.json()["events"])


def test_a_sigkilled_worker_run_is_marked_crashed_by_the_shipped_automation(
    deploy_server: PrefectServer,
) -> None:
    """Host loss: the worker and the flow run's process die by SIGKILL, so nobody reports a
    final state; the heartbeat automation (30 s heartbeats, 35 s window) marks it Crashed."""
    from slurmgate.testbed.emulator.testing import running_emulator

    window = run_script_venv(deploy_server, "--within", "35", "--heartbeat", "30")
    assert window.returncode == 0, window.stderr
    with running_emulator({"a": 4}, token=TOKEN) as emu:
        save_default_blocks(deploy_server, emu)
        emu.admin.fault("latency", ms=3000)  # a tick that takes minutes: still running when killed
        log = deploy_server.home / "worker.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "slurmgate"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=venv_env(
                    deploy_server,
                    PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30",
                    PREFECT_WORKER_QUERY_SECONDS="1",
                    SLURMGATE_STATE_DIR=str(deploy_server.home / "state"),
                ),
                cwd=str(REPO),
                start_new_session=True,
            )
        try:
            run = deploy_server.create_run("reconcile/reconcile", {})
            deploy_server.wait_state(run["id"], {"RUNNING"}, timeout=60)
            deadline = time.monotonic() + 30
            while not heartbeats_seen(deploy_server, run["id"]):
                assert time.monotonic() < deadline, "the run sent no heartbeat"
                time.sleep(0.5)
            pids = flow_run_processes(run["id"])
            assert pids, log.read_text(errors="replace")[-2000:]
            os.killpg(worker.pid, signal.SIGKILL)  # first the worker, so it reports nothing
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            assert deploy_server.state(run["id"]) == "RUNNING"
            crashed = deploy_server.wait_state(run["id"], {"CRASHED"}, timeout=75)
            print(f"marked Crashed {time.monotonic() - killed:.1f} s after SIGKILL")
            assert "no heartbeat for 35 s" in crashed["state"]["message"], crashed["state"]
        finally:
            emu.admin.clear_faults()
            stop_group(worker)
