"""A wrong scope, a bad token or a missing permission is one line naming the request and fix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmgate.github.access import (
    ORG_RUNNER_PERMISSIONS,
    REPO_RUNNER_PERMISSIONS,
    ScopeAccessError,
    check_access,
)
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

REPO_ROOT = Path(__file__).resolve().parents[2]


async def refusal(scope: GitHubScope, token: str) -> str:
    with pytest.raises(ScopeAccessError) as info:
        await check_access(scope, token)
    return str(info.value)


async def test_a_readable_scope_counts_its_runners(emu: RunningEmulator) -> None:
    assert await check_access(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token) == 9


async def test_unknown_repository_names_the_request_and_the_permission(
    emu: RunningEmulator,
) -> None:
    line = await refusal(GitHubScope(api_url=emu.url, repo="nobody/nothing"), emu.token)
    assert line == (
        "GitHub answered 404 for GET /repos/nobody/nothing/actions/runners: the repository "
        f"does not exist or the token cannot see it; the token needs {REPO_RUNNER_PERMISSIONS}"
    )
    assert "{owner}" not in line


async def test_unknown_organisation_names_the_org_permission(emu: RunningEmulator) -> None:
    line = await refusal(GitHubScope(api_url=emu.url, org="nobody"), emu.token)
    assert line.startswith("GitHub answered 404 for GET /orgs/nobody/actions/runners: ")
    assert "organisation does not exist" in line and ORG_RUNNER_PERMISSIONS in line
    assert "Self-hosted runners: read and write" in line


def test_bad_token_and_missing_permission() -> None:
    with running_emulator({"h100": 1}, token="the-right-one") as emu:
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        line = asyncio.run(refusal(scope, "a-wrong-one"))
        assert line.startswith("GitHub answered 401 for GET /repos/acme/gpu-ci/actions/runners:")
        assert "token is not valid" in line and REPO_RUNNER_PERMISSIONS in line
        emu.admin.fault("status", status=403, path="/repos/acme/gpu-ci/actions/runners")
        line = asyncio.run(refusal(scope, "the-right-one"))
        assert line.startswith("GitHub answered 403 for GET /repos/acme/gpu-ci/actions/runners")
        assert "lacks a permission" in line and REPO_RUNNER_PERMISSIONS in line


async def test_a_server_that_is_down_is_named() -> None:
    line = await refusal(GitHubScope(api_url="http://127.0.0.1:9", repo="acme/gpu-ci"), "x")
    assert line.startswith("cannot reach http://127.0.0.1:9 (GET /repos/acme/gpu-ci/")


@pytest.mark.parametrize("command", ["reconcile", "status"])
def test_commands_refuse_a_wrong_repository_in_one_line_before_prefect(
    emu: RunningEmulator, command: str
) -> None:
    """The reconcile tick used to fail inside a flow run: a NotFound with the path's
    placeholders unfilled, after a Prefect traceback and the temporary server's start."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", command, "--api-url", emu.url]
        + ["--repo", "nobody/nothing"]
        + (["--once"] if command == "reconcile" else []),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, "GITHUB_TOKEN": emu.token},
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines() == [
        "error: GitHub answered 404 for GET /repos/nobody/nothing/actions/runners: the "
        "repository does not exist or the token cannot see it; the token needs "
        + REPO_RUNNER_PERMISSIONS
    ]
    assert out.stdout == ""
    assert time.monotonic() - started < 15  # no temporary Prefect server was started
