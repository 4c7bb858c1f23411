"""The built wheel in a fresh venv: `slurmgate deploy` from an empty directory, and a worker.

As operators run it, on a server of its own with basic auth: the wheel is built from this
checkout and installed into a new venv, and everything below runs from directories that are
not a checkout, so the deployments can only reach the installed `slurmgate.flows`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import (
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


def venv_env(server: PrefectServer, bindir: Path, **extra: str) -> dict[str, str]:
    """A client environment with `bindir` first on PATH (the build step runs its `python`) and
    no PYTHONPATH: nothing of the checkout is importable."""
    env = server.env(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", **extra)
    env.pop("PYTHONPATH")
    return env


def test_the_wheel_installs_one_namespace_and_imports_from_the_venv(wheel_venv: Path) -> None:
    code = (
        "import importlib.util, json, slurmgate.flows.reconcile as r, slurmgate.blocks as b;"
        "from importlib.metadata import entry_points;"
        "print(json.dumps({'flows': r.__file__, 'blocks': b.__file__,"
        " 'generic': [n for n in ('blocks', 'tasks', 'flows', 'deployments')"
        "             if importlib.util.find_spec(n)],"
        " 'collections': sorted({e.value for e in entry_points(group='prefect.collections')"
        "                        if e.name == 'slurmgate'})}))"
    )
    ran = subprocess.run(
        [str(wheel_venv / "python"), "-c", code],
        capture_output=True, text=True, cwd=wheel_venv, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    found = json.loads(ran.stdout)
    venv = str(wheel_venv.parent)
    assert found["flows"].startswith(venv) and found["blocks"].startswith(venv), found
    assert found["generic"] == []  # no `blocks`, `tasks`, `flows` packages of their own
    assert found["collections"] == ["slurmgate.blocks"]


def run_in_venv(
    server: PrefectServer, bindir: Path, cwd: Path, *argv: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A command of the wheel's venv, run from `cwd` (never the checkout)."""
    return subprocess.run(
        [str(bindir / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        env=venv_env(server, bindir),
        cwd=str(cwd),
        timeout=timeout,
        check=False,
    )


def test_deploy_all_creates_the_three_deployments_and_the_heartbeat_automation(
    deploy_server: PrefectServer, wheel_venv: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "ops"  # an operator's directory: no checkout, no prefect.yaml
    empty.mkdir()
    pool = run_in_venv(
        deploy_server, wheel_venv, empty,
        "python", "-m", "prefect", "work-pool", "create", "slurmgate", "--type", "process",
    )  # fmt: skip
    assert pool.returncode == 0, pool.stdout + pool.stderr
    for _ in range(2):  # deploying again updates in place
        deploy = run_in_venv(deploy_server, wheel_venv, empty, "slurmgate", "deploy")
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    assert sorted(p.name for p in empty.iterdir()) == []  # nothing copied or written here

    api = deploy_server.api
    deployments = api.post("/deployments/filter", json={}).json()
    assert sorted(d["entrypoint"] for d in deployments) == [
        "slurmgate.flows.allocation.allocation",
        "slurmgate.flows.reconcile.reconcile",
        "slurmgate.flows.release.release_lease",
    ]
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
    deploy_server: PrefectServer, wheel_venv: Path, tmp_path: Path
) -> None:
    """Host loss: the worker and the flow run's process die by SIGKILL, so nobody reports a
    final state; the heartbeat automation (30 s heartbeats, 35 s window) marks it Crashed."""
    from slurmgate.testbed.emulator.testing import running_emulator

    window = run_in_venv(
        deploy_server, wheel_venv, tmp_path, "python", "-m", "slurmgate.deployments.automations",
        "--within", "35", "--heartbeat", "30",
    )  # fmt: skip
    assert window.returncode == 0, window.stderr
    with running_emulator({"a": 4}, token=TOKEN) as emu:
        save_default_blocks(deploy_server, emu)
        deploy_server.pause_schedule("reconcile/reconcile")
        emu.admin.fault("latency", ms=3000)  # a tick that takes minutes: still running when killed
        log = deploy_server.home / "worker.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                [
                    str(wheel_venv / "python"),
                    "-m",
                    "prefect",
                    "worker",
                    "start",
                    "--pool",
                    "slurmgate",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=venv_env(
                    deploy_server,
                    wheel_venv,
                    PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30",
                    PREFECT_WORKER_QUERY_SECONDS="1",
                    SLURMGATE_STATE_DIR=str(deploy_server.home / "state"),
                ),
                cwd=str(tmp_path),  # the run imports the installed flows, not the checkout's
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
