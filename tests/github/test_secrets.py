"""The token never shows in logs, exceptions, reprs or tracebacks, including failed requests."""

from __future__ import annotations

import logging
import socket
import traceback

import pytest
from pydantic import SecretStr

from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import AuthError, GitHubError, TransientError
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.testing import running_emulator

TOKEN = "ghp_sl4rmg4teTOPsecretTOKEN0123456789"
OTHER = "ghp_wrongTOKENnotTHEoneZZZZ987654321"


def _assert_clean(text: str) -> None:
    assert TOKEN not in text
    assert OTHER not in text


def _assert_exception_clean(exc: GitHubError) -> None:
    _assert_clean(str(exc))
    _assert_clean(repr(exc))
    _assert_clean("".join(traceback.format_exception(exc)))
    # no httpx request (with its Authorization header) rides along on the exception
    assert exc.__cause__ is None and exc.__context__ is None
    assert all(isinstance(v, str | int | float | type(None)) for v in vars(exc).values())


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "slurmgate", "uvicorn", "uvicorn.error"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


async def test_token_absent_from_logs_and_errors(debug_logs: pytest.LogCaptureFixture) -> None:
    with running_emulator(pools={"p": 2}, token=TOKEN) as emu:
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        async with GitHubClient(scope, SecretStr(TOKEN), max_retries=1, backoff_base_s=0.01) as gh:
            _assert_clean(repr(gh))
            _assert_clean(str(gh))
            await gh.list_runners()
            await gh.add_labels(1, ["ci-lease-j1-a1-t1"])
            await gh.remove_label(1, "absent-label")
            emu.admin.fault("status", count=5, status=503)
            with pytest.raises(TransientError) as transient:
                await gh.list_runners(conditional=False)
            _assert_exception_clean(transient.value)
        async with GitHubClient(scope, OTHER) as wrong:
            with pytest.raises(AuthError) as auth:
                await wrong.get_runner(1)
            _assert_exception_clean(auth.value)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = GitHubScope(api_url=f"http://127.0.0.1:{port}", repo="acme/gpu-ci")
    async with GitHubClient(dead, TOKEN, max_retries=0) as gh:
        with pytest.raises(TransientError) as refused:
            await gh.get_job(1)
        _assert_exception_clean(refused.value)
    # the capture really saw the requests (so the check above is not vacuous)
    assert any(r.name.startswith("httpcore") for r in debug_logs.records)
    assert "503" in debug_logs.text and "401" in debug_logs.text
    _assert_clean(debug_logs.text)
    for record in debug_logs.records:
        _assert_clean(repr(record.args))
