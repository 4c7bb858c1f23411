"""A throw-away `prefect server start` on a free loopback port, for the demo, tests and benches.

It starts Prefect as a child process and talks to it over its REST API only, so the core never
imports prefect. SQLite lives in `home` unless a database URL is given. The deployment helpers
at the end read any server's API.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict

from slurmgate.errors import ExternalError
from slurmgate.prefect_db import migrated, seed_prefect_database
from slurmgate.settings.handed import inherited
from slurmgate.settings.prefect import PrefectSettings
from slurmgate.testbed.localproc import free_port, stop_group


class PrefectServerError(ExternalError):
    """The server did not come up; the message names its log."""


@dataclass(frozen=True)
class PrefectServerProcess:
    """A running server: its root URL, its log, and how long it took to answer /health."""

    url: str
    home: Path
    log: Path
    startup_s: float
    auth: str | None = None

    @property
    def api_url(self) -> str:
        return self.url + "/api"


def server_env(
    prefect_home: Path, port: int, *, auth: str | None, database_url: str | None
) -> dict[str, str]:
    """The server's environment: this one without any Prefect setting, then its own.

    Telemetry is off, as in every command of ours, unless the user turned it on explicitly.
    """
    env = {k: v for k, v in inherited().items() if not k.startswith("PREFECT_")}
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(
        PREFECT_HOME=str(prefect_home),
        PREFECT_SERVER_ANALYTICS_ENABLED=PrefectSettings.environ().get(
            "PREFECT_SERVER_ANALYTICS_ENABLED", "false"
        ),
        PREFECT_SERVER_LOG_RETRYABLE_ERRORS="true",  # one log line per 503 the server sends
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",
    )
    if auth:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    if database_url:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
    return env


@contextlib.contextmanager
def running_prefect_server(
    home: Path,
    *,
    log: Path | None = None,
    prefect_home: Path | None = None,
    auth: str | None = None,
    database_url: str | None = None,
    startup_timeout_s: float = 120.0,
) -> Iterator[PrefectServerProcess]:
    """Start the server with its state (`home/server`) and `server.log` in `home`, unless `log`
    and `prefect_home` say otherwise; stop its process group after.

    `auth` ("user:pass") turns on basic auth. Raises PrefectServerError naming the log when the
    server exits or does not answer /api/health within `startup_timeout_s`.
    """
    home.mkdir(parents=True, exist_ok=True)
    log = log or home / "server.log"
    if database_url is None:
        seed_prefect_database(prefect_home or home / "server")
    basic = tuple(auth.split(":", 1)) if auth else None
    started = time.perf_counter()
    # free_port() closes its socket before the server binds it: another process can take the
    # port in between (seen once in a full test run), so a taken port gets a fresh one
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        env = server_env(
            prefect_home or home / "server", port, auth=auth, database_url=database_url
        )
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*SERVER_ARGV, "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(proc, url, log, basic, startup_timeout_s)
        except PrefectServerError as exc:
            stop_group(proc, timeout=20.0)
            if "is already in use" in str(exc) and attempt < PORT_ATTEMPTS:
                continue
            raise
        except BaseException:
            stop_group(proc, timeout=20.0)
            raise
        break
    try:
        yield PrefectServerProcess(url, home, log, time.perf_counter() - started, auth)
    finally:
        stop_group(proc, timeout=20.0)


SERVER_ARGV = (sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1")
UPGRADE_ARGV = (sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y")


def migrated_database(cache_dir: Path, *, timeout_s: float = 300.0) -> Path:
    """A SQLite database Prefect's migrations brought to head, built once per Prefect version in
    `cache_dir` (`prefect server database upgrade` in a throw-away home): the template
    SLURMGATE_PREFECT_DB_TEMPLATE names. Two builders at once each finish their own copy and
    the last rename wins; both are the same database."""
    target = cache_dir / f"prefect-{importlib.metadata.version('prefect')}.db"
    if migrated(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".prefect-db-") as scratch:
        env = {k: v for k, v in inherited().items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=scratch, DO_NOT_TRACK="1")
        done = subprocess.run(
            UPGRADE_ARGV, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        built = Path(scratch) / "prefect.db"
        if done.returncode != 0 or not migrated(built):
            raise PrefectServerError(
                f"prefect server database upgrade exited with {done.returncode}:\n"
                + (done.stdout + done.stderr)[-2000:]
            )
        os.replace(built, target)
    return target


PORT_ATTEMPTS = 3


def _wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    log: Path,
    basic: tuple[str, ...] | None,
    startup_timeout_s: float,
) -> None:
    """Until /api/health answers 200; PrefectServerError naming the log if the server exits or
    stays silent past `startup_timeout_s`."""
    with httpx.Client(timeout=2.0, auth=basic) as http:  # type: ignore[arg-type]
        deadline = time.monotonic() + startup_timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if http.get(url + "/api/health").status_code == 200:
                    return
            if proc.poll() is not None:
                raise PrefectServerError(
                    f"prefect server exited with {proc.returncode}; see {log}:\n"
                    + log.read_text(errors="replace")[-3000:]
                )
            if time.monotonic() > deadline:
                raise PrefectServerError(
                    f"prefect server did not answer /api/health within "
                    f"{startup_timeout_s:.0f} s; see {log}"
                )
            time.sleep(0.3)


class FlowRunSummary(BaseModel):
    """A flow run as the REST API lists it, reduced to what a test or a benchmark reads."""

    model_config = ConfigDict(extra="ignore")

    id: str = ""
    name: str
    state_type: str | None = None
    state_name: str | None = None
    start_time: datetime | None = None
    expected_start_time: datetime | None = None

    @property
    def final(self) -> bool:
        return self.state_type in FINAL_STATES


FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


def _deployment_id(http: httpx.Client, full_name: str) -> str | None:
    response = http.get(f"/deployments/name/{full_name}")
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return str(response.json()["id"])


def deployment_ready(api_url: str, full_name: str, automations: int = 0) -> bool:
    """The deployment `flow/name` exists and owns `automations` automations (its event triggers,
    which `serve()` creates just after the deployment: events in between would be missed)."""
    with httpx.Client(base_url=api_url, timeout=10.0) as http:
        deployment_id = _deployment_id(http, full_name)
        if deployment_id is None:
            return False
        owned = http.get(f"/automations/related-to/prefect.deployment.{deployment_id}")
        owned.raise_for_status()
        return len(owned.json()) >= automations


def deployment_runs(api_url: str, full_name: str) -> list[FlowRunSummary]:
    """Every flow run of the deployment `flow/name` (none when it does not exist)."""
    with httpx.Client(base_url=api_url, timeout=10.0) as http:
        deployment_id = _deployment_id(http, full_name)
        if deployment_id is None:
            return []
        body = {"deployments": {"id": {"any_": [deployment_id]}}, "limit": 200}
        response = http.post("/flow_runs/filter", json=body)
        response.raise_for_status()
        return [FlowRunSummary.model_validate(run) for run in response.json()]
