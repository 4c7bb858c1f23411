"""One real `prefect server start` (loopback, SQLite) and `deployments/serve.py` for this folder.

Everything talks to the server the way CI and the UI do: plain REST on `/api`. The served
process runs the three deployments from the checkout, polling every second.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from slurmgate.testbed.localproc import stop_group
from slurmgate.testbed.prefect_server import PrefectServerError
from slurmgate.testbed.prefect_server import running_prefect_server as server_process

REPO = Path(__file__).resolve().parents[2]
TOKEN = "ghs_PREFECTserverSECRET0123456789"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}

pytestmark = pytest.mark.prefect_server


class RetryingClient(httpx.Client):
    """An httpx client that retries the SQLite server's 503s ("database is busy") with a short
    backoff, as a CI script should (an idempotency key makes a repeated create safe)."""

    retried_503 = 0

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        delay = 0.2
        for _ in range(8):
            response = super().send(request, **kwargs)
            if response.status_code != 503:
                return response
            RetryingClient.retried_503 += 1
            time.sleep(delay)
            delay = min(delay * 2, 3.0)
        return response


@dataclass
class PrefectServer:
    """A running server: `url` is the UI root, `api` an httpx client on `/api`."""

    url: str
    api: httpx.Client
    home: Path
    log: Path
    auth: str | None = None

    @property
    def api_url(self) -> str:
        return self.url + "/api"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a Prefect client process pointed at this server."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_HOME=str(self.home / "client"),
            DO_NOT_TRACK="1",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PYTHONPATH=str(REPO),
        )
        if self.auth:
            env["PREFECT_API_AUTH_STRING"] = self.auth
        env.update(extra)
        return env

    @contextlib.contextmanager
    def client_settings(self) -> Iterator[None]:
        """Point this process's Prefect client at the server, only for the `with` block (the
        rest of the suite keeps its own test harness)."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        updates: dict[Any, Any] = {PREFECT_API_URL: self.api_url}
        if self.auth:
            updates[PREFECT_API_AUTH_STRING] = self.auth
        with temporary_settings(updates):
            yield

    def deployment_id(self, name: str) -> str:
        response = self.api.get(f"/deployments/name/{name}")
        response.raise_for_status()
        return str(response.json()["id"])

    def pause_schedule(self, name: str) -> None:
        """Pause a deployment's schedule and delete the runs it already scheduled: a scheduled
        run a worker picks up first would hold a deployment's one concurrency slot."""
        deployment = self.deployment_id(name)
        response = self.api.patch(f"/deployments/{deployment}", json={"paused": True})
        assert response.status_code in (200, 204), response.text
        flt = {"deployment_id": {"any_": [deployment]}, "state": {"type": {"any_": ["SCHEDULED"]}}}
        scheduled = self.api.post("/flow_runs/filter", json={"flow_runs": flt}).json()
        for run in scheduled:
            self.api.delete(f"/flow_runs/{run['id']}")

    def create_run(
        self, name: str, parameters: dict[str, Any], idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """What CI does: look the deployment up by name, then create a run with parameters."""
        body: dict[str, Any] = {"parameters": parameters, "tags": ["ci"]}
        body["idempotency_key"] = idempotency_key or f"test-{uuid.uuid4()}"
        response = self.api.post(
            f"/deployments/{self.deployment_id(name)}/create_flow_run", json=body
        )
        assert response.status_code in (200, 201), response.text
        run: dict[str, Any] = response.json()
        return run

    def run(self, run_id: str) -> dict[str, Any]:
        response = self.api.get(f"/flow_runs/{run_id}")
        response.raise_for_status()
        run: dict[str, Any] = response.json()
        return run

    def state(self, run_id: str) -> str:
        state = self.run(run_id)["state"]
        return str(state["type"]) if state else "NONE"

    def wait_state(self, run_id: str, states: set[str], timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run["state"] and run["state"]["type"] in states:
                return run
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"flow run {run['name']} is {run['state']}, not {states} after {timeout} s; "
                    f"logs:\n{self.logs(run_id)}"
                )
            time.sleep(0.25)

    def logs(self, run_id: str) -> str:
        response = self.api.post(
            "/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
        )
        return "\n".join(entry["message"] for entry in response.json())

    def wait_log(self, run_id: str, text: str, timeout: float = 15.0) -> str:
        """The run's logs once `text` is among them (logs reach the API after the state)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = self.logs(run_id)
            if text in logs:
                return logs
            assert time.monotonic() < deadline, f"{text!r} not logged by {run_id}:\n{logs}"
            time.sleep(0.3)

    def run_family(self, run_id: str) -> list[str]:
        """The run and its subflow runs."""
        response = self.api.post(
            "/flow_runs/filter",
            json={"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}, "limit": 50},
        )
        response.raise_for_status()
        return [run_id, *(str(r["id"]) for r in response.json())]

    def artifacts(self, run_ids: list[str]) -> list[dict[str, Any]]:
        response = self.api.post(
            "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": run_ids}}}
        )
        response.raise_for_status()
        found: list[dict[str, Any]] = response.json()
        return found


@contextlib.contextmanager
def running_prefect_server(home: Path, auth: str | None = None) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port with SQLite in `home` (its PREFECT_HOME,
    logs and the served process's state); `auth` ("user:pass") turns on basic auth."""
    try:
        with server_process(home, auth=auth, startup_timeout_s=90) as proc:
            basic = tuple(auth.split(":", 1)) if auth else None
            api = RetryingClient(base_url=proc.api_url, timeout=30.0, auth=basic)  # type: ignore[arg-type]
            try:
                yield PrefectServer(proc.url, api, home, proc.log, auth)
            finally:
                print(
                    f"\nprefect server: {RetryingClient.retried_503} REST call(s) retried after 503"
                )
                api.close()
    except PrefectServerError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """The session's server, shared by every module here but test_deploy."""
    with running_prefect_server(tmp_path_factory.mktemp("prefect-server")) as server:
        yield server


@pytest.fixture(scope="session")
def emulator() -> Iterator[Any]:
    """A GitHub emulator with one 4-runner pool; its token is the one the scope block holds."""
    from slurmgate.testbed.emulator.testing import running_emulator

    with running_emulator({"a": 4}, token=TOKEN) as emu:
        yield emu


def save_default_blocks(server: PrefectServer, emulator: Any) -> None:
    """Save the `default` scope and policy blocks on `server`, the scope on `emulator`."""
    from slurmgate.blocks import AdmissionPolicyBlock, GitHubScopeBlock

    with server.client_settings():
        GitHubScopeBlock(
            api_url=emulator.url, repo=emulator.repo, token=TOKEN, min_write_interval_s=0
        ).save("default", overwrite=True)
        AdmissionPolicyBlock(
            priority_scheduler_enabled=True, node_slot_scheduler_enabled=True, orphan_grace_s=0
        ).save("default", overwrite=True)


@pytest.fixture(scope="session")
def saved_blocks(prefect_server: PrefectServer, emulator: Any) -> dict[str, str]:
    """The `default` scope (pointing at the emulator) and policy blocks the deployments name."""
    save_default_blocks(prefect_server, emulator)
    return {"scope": "default", "policy": "default"}


DEPLOYMENTS = ("reconcile/reconcile", "release-lease/release-lease", "allocation/allocation")


@pytest.fixture(scope="session")
def served(prefect_server: PrefectServer, saved_blocks: dict[str, str]) -> Iterator[PrefectServer]:
    """`python -m slurmgate.deployments.serve` polling every second; the schedule is an hour
    apart so that only the tests start runs."""
    log = prefect_server.home / "serve.log"
    env = prefect_server.env(
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        SLURMGATE_STATE_DIR=str(prefect_server.home / "state"),
        SLURMGATE_PRESETS_DIR=str(prefect_server.home / "site-specs"),
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurmgate.deployments.serve", "--interval", "3600"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        for name in DEPLOYMENTS:
            while prefect_server.api.get(f"/deployments/name/{name}").status_code != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"serve.py did not register {name}:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        yield prefect_server
    finally:
        stop_group(proc)
        served_log = log.read_text(errors="replace")
        assert TOKEN not in served_log, "the GitHub token reached the serve process's output"


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    """Keep each phase's report on the item, so fixtures can tell a failed test (screenshots)."""
    outcome = yield
    setattr(item, "rep_" + call.when, outcome.get_result())
