"""`slurmgate webhook`: one-line errors, a real process on --port 0, basic auth to Prefect."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from relaykit import SECRET, deliver, job_payload, wait_for_events
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from typer.testing import CliRunner

from slurmgate.cli.app import app
from slurmgate.github.webhook import RelayServer, RelaySettings

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURMGATE_WEBHOOK_SECRET", "PREFECT_API_URL", "PREFECT_API_AUTH_STRING"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        ([], {"PREFECT_API_URL": "http://127.0.0.1:1/api"}, "SLURMGATE_WEBHOOK_SECRET"),
        ([], {"SLURMGATE_WEBHOOK_SECRET": "s"}, "PREFECT_API_URL"),
        (
            ["--prefect-api-url", "127.0.0.1:4200"],
            {"SLURMGATE_WEBHOOK_SECRET": "s"},
            "prefect_api_url",
        ),
        (["--port", "70000"], {"SLURMGATE_WEBHOOK_SECRET": "s"}, "--port"),
        (["--secret-file", "/nonexistent/secret"], {}, "--secret-file"),
        (
            ["--max-age", "0", "--prefect-api-url", "http://x/api"],
            {"SLURMGATE_WEBHOOK_SECRET": "s"},
            "max_age_s",
        ),
        (
            ["--max-buffered-bytes", "100000", "--prefect-api-url", "http://x/api"],
            {"SLURMGATE_WEBHOOK_SECRET": "s"},
            "max_buffered_bytes 100000 is below max_body_bytes",
        ),
        (
            ["--header-timeout", "0", "--prefect-api-url", "http://x/api"],
            {"SLURMGATE_WEBHOOK_SECRET": "s"},
            "header_timeout_s",
        ),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], needle
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, ["webhook", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_the_command_serves_and_never_prints_the_secret(prefect_api: str, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    env.pop("SLURMGATE_WEBHOOK_SECRET", None)
    cmd = [sys.executable, "-m", "slurmgate.cli", "webhook", "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--secret-file", str(secret_file)],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/webhook)", banner)
        assert match, banner
        url = match.group(1)
        delivery = str(uuid.uuid4())
        assert deliver(url, job_payload(97001), delivery=delivery).status_code == 202
        assert deliver(url, job_payload(97001), delivery=delivery).status_code == 200
        assert deliver(url, job_payload(97002), secret="nope").status_code == 401
        events = wait_for_events(prefect_api, 1, any_resource={"id": ["github.workflow_job.97001"]})
        assert len(events) == 1
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
    assert SECRET not in banner + out + err


class HeaderRecorder:
    """A real HTTP server standing in for a Prefect API that requires basic auth."""

    def __init__(self, stall_s: float = 0.0) -> None:
        self.seen: list[str | None] = []

        async def events(request: Request) -> Response:
            self.seen.append(request.headers.get("authorization"))
            if stall_s:
                await asyncio.sleep(stall_s)
            ok = request.headers.get("authorization") == "Basic YWRtaW46czNjcjN0OnB3"
            return Response(status_code=204 if ok else 401)

        config = uvicorn.Config(
            Starlette(routes=[Route("/api/events", events, methods=["POST"])]),
            host="127.0.0.1",
            port=0,
            log_config=None,
            log_level="warning",
            timeout_graceful_shutdown=1,  # a stalled request must not hold up teardown
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> HeaderRecorder:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/api"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_prefect_auth_string_is_sent_as_basic_auth() -> None:
    with HeaderRecorder() as prefect:
        # the password itself contains a colon: only the first one separates user and password
        settings = RelaySettings(
            secret=SECRET, prefect_api_url=prefect.url, prefect_auth_string="admin:s3cr3t:pw"
        )
        with RelayServer(settings) as relay:
            assert deliver(relay.url, job_payload(98001)).status_code == 202
        wrong = RelaySettings(
            secret=SECRET, prefect_api_url=prefect.url, prefect_auth_string="admin:guess"
        )
        with RelayServer(wrong) as relay:
            # Prefect refuses the event: GitHub is told to retry (503), nothing is half-done
            assert deliver(relay.url, job_payload(98002)).status_code == 503
        no_auth = RelaySettings(secret=SECRET, prefect_api_url=prefect.url)
        with RelayServer(no_auth) as relay:
            assert deliver(relay.url, job_payload(98003)).status_code == 503
    assert prefect.seen == ["Basic YWRtaW46czNjcjN0OnB3", "Basic YWRtaW46Z3Vlc3M=", None]


def test_a_hanging_prefect_still_gets_github_an_answer_in_time() -> None:
    """GitHub counts a delivery failed after 10 s: the relay gives up on Prefect first (503)."""
    with HeaderRecorder(stall_s=30) as prefect:
        settings = RelaySettings(secret=SECRET, prefect_api_url=prefect.url, post_timeout_s=1.5)
        with RelayServer(settings) as relay:
            delivery = str(uuid.uuid4())
            started = time.monotonic()
            response = deliver(relay.url, job_payload(99001), delivery=delivery)
            elapsed = time.monotonic() - started
            assert response.status_code == 503
            assert 1.4 <= elapsed < 5, elapsed
            # the delivery id was released: GitHub's redelivery is tried again, not dropped
            assert deliver(relay.url, job_payload(99001), delivery=delivery).status_code == 503
            assert relay.stats["duplicates"] == 0
        # the default keeps the answer inside GitHub's 10 s
        assert RelaySettings(secret="s", prefect_api_url="http://x/api").post_timeout_s < 10
