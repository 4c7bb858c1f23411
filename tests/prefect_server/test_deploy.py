"""`prefect deploy --all` with deployments/prefect.yaml on its own server, as operators run it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import REPO, PrefectServer, running_prefect_server

pytestmark = pytest.mark.prefect_server

AUTH_PASSWORD = "s3cret-AUTH-pass"


@pytest.fixture(scope="module")
def deploy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A server of its own (deploying replaces the served deployments of the same names), with
    basic auth on, as a server that others can reach should run."""
    home = tmp_path_factory.mktemp("deploy-server")
    with running_prefect_server(home, auth=f"ops:{AUTH_PASSWORD}") as server:
        yield server


def prefect_cli(server: PrefectServer, *args: str) -> subprocess.CompletedProcess[str]:
    """`prefect ...` from the activated venv (the build step runs its `python`)."""
    venv_bin = str(Path(sys.executable).parent)
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        capture_output=True,
        text=True,
        env=server.env(PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"),
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
