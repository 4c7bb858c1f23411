"""GitHub App authentication against the emulator: the JWT, installation tokens, their refresh,
the emulator's App endpoints (validated against GitHub's OpenAPI), and what a wrong key says.

GitHub's rules: https://docs.github.com/en/apps/creating-github-apps/authenticating-with-a-
github-app/generating-a-json-web-token-jwt-for-a-github-app (RS256, `iat` 60 s in the past,
`exp` at most 10 minutes ahead, `iss` the App id) and .../authenticating-as-a-github-app-
installation (`POST /app/installations/{installation_id}/access_tokens`, one-hour tokens).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from pydantic import SecretStr

from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.errors import SlurmgateError
from slurmgate.github.access import ScopeAccessError, check_access, explain
from slurmgate.github.app_auth import (
    APP_ID_ENV,
    APP_INSTALLATION_ID_ENV,
    APP_PRIVATE_KEY_ENV,
    APP_PRIVATE_KEY_FILE_ENV,
    AppAuthError,
    AppCredentialsError,
    GitHubAppCredentials,
    InstallationTokenProvider,
    credentials_from_env,
)
from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import AuthError, NotFound, accepted_permissions
from slurmgate.github.scope import GitHubScope
from slurmgate.runtime.redact import redact_patterns
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.apps import new_private_key
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

Validate = Callable[[httpx.Response], None]
REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = AdmissionSettings(
    PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True, orphan_grace_s=0
)


def job_labels(nodes: int, token: str) -> list[str]:
    return ["self-hosted", "cluster:a", f"nodes:{nodes}", f"ci-job-1.000-{token}", "ci-attempt-1"]


def key_body(pem: str) -> str:
    """The base64 middle of a PEM key: what a leak of the key would show."""
    return "".join(line for line in pem.splitlines() if "-----" not in line)


@pytest.fixture
def app_emu() -> Iterator[tuple[RunningEmulator, dict[str, Any]]]:
    """An emulator (pool a: 4 runners) with one App installed on its owner."""
    with running_emulator({"a": 4}) as emu:
        yield emu, emu.admin.create_app()


def credentials(app: dict[str, Any], **overrides: Any) -> GitHubAppCredentials:
    return GitHubAppCredentials(
        overrides.get("app_id", app["app_id"]),
        SecretStr(overrides.get("private_key", app["private_key"])),
        overrides.get("installation_id"),
    )


def test_the_jwt_is_what_github_asks_for() -> None:
    pem = new_private_key()
    creds = GitHubAppCredentials(123456, SecretStr(pem))
    now = int(time.time())
    token = creds.jwt(now)
    public = serialization.load_pem_private_key(pem.encode(), None).public_key()
    assert jwt.get_unverified_header(token)["alg"] == "RS256"
    claims = jwt.decode(token, public, algorithms=["RS256"], options={"verify_exp": False})  # type: ignore[arg-type]
    assert claims == {"iat": now - 60, "exp": now + 540, "iss": "123456"}
    assert claims["exp"] - now <= 600


async def test_installation_token_is_looked_up_issued_and_used(
    app_emu: tuple[RunningEmulator, dict[str, Any]],
) -> None:
    emu, app = app_emu
    for scope in (
        GitHubScope(api_url=emu.url, repo=emu.repo),
        GitHubScope(api_url=emu.url, org=emu.owner, repos=(emu.repo,)),
    ):
        async with GitHubClient(scope, credentials(app)) as gh:
            assert len(await gh.list_runners()) == 4
            assert gh.app_auth is not None
            # no installation id given: found from the repository or the organization
            assert gh.app_auth.provider.installation_id == app["installation_id"]
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), credentials(app)) as gh:
        await gh.list_runners()  # a later client (the next tick) shares the cached token
    stats = emu.admin.app_stats()
    assert stats["tokens_issued"] == 2  # one per lookup target (the repo, the org), not per client
    assert stats["tokens_refused"] == stats["jwts_refused"] == 0


async def test_token_is_cached_and_refreshed_five_minutes_before_it_expires() -> None:
    offset = [0.0]  # time passes for both sides: the emulator and the controller

    def clock() -> float:
        return time.time() + offset[0]

    with running_emulator({"a": 1}, clock=clock) as emu:
        app = emu.admin.create_app()
        provider = InstallationTokenProvider(
            credentials(app, installation_id=app["installation_id"]),
            GitHubScope(api_url=emu.url, repo=emu.repo),
            clock=clock,
        )
        first, fresh = await provider.token()
        assert fresh and first.startswith("ghs_")
        offset[0] = 3600 - 300 - 30  # 5 1/2 minutes before the hour's token expires: cached
        assert await provider.token() == (first, False)
        offset[0] = 3600 - 300 + 30  # under 5 minutes left: a new one
        second, fresh = await provider.token()
        assert fresh and second != first and provider.issued == 2
        assert emu.admin.app_stats()["tokens_issued"] == 2


async def test_a_token_that_expires_mid_tick_is_refreshed_and_the_tick_completes(
    app_emu: tuple[RunningEmulator, dict[str, Any]],
) -> None:
    emu, app = app_emu
    job = emu.admin.add_job(job_labels(2, "mid"), duration_s=600)["id"]
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), credentials(app)) as gh:
        await gh.list_runners()  # the token is issued and cached
        emu.admin.expire_app_tokens(after_requests=2)  # GitHub drops it two requests later
        report = await reconcile_tick(direct_steps(gh), SETTINGS)
    assert report.failures == [] and report.admitted == 1
    assert emu.job_placement(job)[0] in ("queued", "in_progress")
    stats = emu.admin.app_stats()
    assert stats["tokens_issued"] == 2 and stats["tokens_refused"] >= 1
    leased = [
        r for r in emu.admin.dump()["runners"] if any("ci-lease-" in x["name"] for x in r["labels"])
    ]
    assert len(leased) == 2


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
async def test_thirty_seconds_of_clock_skew_still_works(skew_s: float) -> None:
    with running_emulator({"a": 2}, clock=lambda: time.time() + skew_s) as emu:
        app = emu.admin.create_app()
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        assert await check_access(scope, credentials(app)) == 2
        assert emu.admin.app_stats()["jwts_refused"] == 0


async def test_a_clock_far_off_is_refused_with_the_apps_id() -> None:
    """The emulator's JWT check is real: 2 minutes behind, `iat` lies in its future."""
    with running_emulator({"a": 2}, clock=lambda: time.time() - 120) as emu:
        app = emu.admin.create_app()
        with pytest.raises(ScopeAccessError) as caught:
            await check_access(GitHubScope(api_url=emu.url, repo=emu.repo), credentials(app))
    assert f"GitHub App {app['app_id']}" in str(caught.value)
    assert "'Issued at' claim" in str(caught.value)


async def test_a_wrong_key_is_one_line_naming_the_app_and_the_fix(
    app_emu: tuple[RunningEmulator, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    emu, app = app_emu
    other = new_private_key()
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ScopeAccessError) as caught:
        await check_access(
            GitHubScope(api_url=emu.url, repo=emu.repo), credentials(app, private_key=other)
        )
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith(f"GitHub App {app['app_id']}: GitHub refused the App's signed JWT")
    assert "401" in line and "SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE" in line
    assert "generate a private key" in line
    chained: BaseException | None = caught.value
    while chained is not None:  # nothing from httpx (which holds the JWT) is chained
        assert isinstance(chained, SlurmgateError) and chained.__cause__ is None
        chained = chained.__context__
    for secret in (key_body(other), key_body(app["private_key"]), "eyJ"):
        assert secret not in line and secret not in caplog.text


async def test_no_secret_in_reprs_errors_or_logs(
    app_emu: tuple[RunningEmulator, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    emu, app = app_emu
    caplog.set_level(logging.DEBUG)
    creds = credentials(app)
    shown: list[str] = [repr(creds), str(creds)]
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), creds) as gh:
        await gh.list_runners()
        emu.admin.expire_app_tokens()
        await gh.list_runners(conditional=False)  # a 401, a refresh and the retry
        assert gh.app_auth is not None
        shown += [repr(gh), str(gh), repr(gh.app_auth), repr(gh.app_auth.provider)]
        shown += [repr(gh.app_auth.provider._token)]
        try:
            await gh.get_runner(999)
        except Exception as exc:  # a NotFound from GitHub: its text must be clean too
            shown += [str(exc), repr(exc)]
    tokens = list(emu.state.apps.tokens)
    assert len(tokens) == 2
    text = "\n".join(shown) + caplog.text
    assert "refreshing it" in caplog.text  # the refresh was logged, without the token
    for secret in [*tokens, key_body(app["private_key"]), "eyJ", "BEGIN RSA"]:
        assert secret not in text
    # an installation token that did reach a run's output would be masked by its shape
    assert {redact_patterns(f"token {token} used") for token in tokens} == {"token *** used"}


def test_bad_credentials_name_the_field_without_the_key() -> None:
    with pytest.raises(AppCredentialsError, match="app_private_key of GitHub App 7 is not"):
        GitHubAppCredentials(7, SecretStr("-----BEGIN RSA PRIVATE KEY-----\nnot-a-key\n"))
    with pytest.raises(AppCredentialsError, match="app_id 0 is not a GitHub App id"):
        GitHubAppCredentials(0, SecretStr(new_private_key()))
    with pytest.raises(AppCredentialsError) as caught:
        GitHubAppCredentials(7, SecretStr("secret-text-that-is-no-key"))
    assert "secret-text" not in str(caught.value)


def test_credentials_from_the_environment(tmp_path: Path) -> None:
    pem = new_private_key()
    key_file = tmp_path / "app.pem"
    key_file.write_text(pem)
    assert credentials_from_env({}) is None
    token = credentials_from_env({"GITHUB_TOKEN": "ghp_x"})
    assert isinstance(token, SecretStr) and token.get_secret_value() == "ghp_x"
    app = credentials_from_env(
        {
            APP_ID_ENV: "42",
            APP_PRIVATE_KEY_FILE_ENV: str(key_file),
            APP_INSTALLATION_ID_ENV: "9",
            "GITHUB_TOKEN": "ghp_x",  # the App wins
        }
    )
    assert isinstance(app, GitHubAppCredentials)
    assert (app.app_id, app.installation_id) == (42, 9)
    inline = credentials_from_env({APP_ID_ENV: "42", APP_PRIVATE_KEY_ENV: pem.replace("\n", "\\n")})
    assert isinstance(inline, GitHubAppCredentials) and inline.fingerprint == app.fingerprint
    with pytest.raises(AppCredentialsError, match=f"\\${APP_ID_ENV} is empty"):
        credentials_from_env({APP_PRIVATE_KEY_FILE_ENV: str(key_file)})
    with pytest.raises(AppCredentialsError, match="has no private key"):
        credentials_from_env({APP_ID_ENV: "42"})
    with pytest.raises(AppCredentialsError, match="cannot be read"):
        credentials_from_env({APP_ID_ENV: "42", APP_PRIVATE_KEY_FILE_ENV: str(tmp_path / "no")})
    with pytest.raises(AppCredentialsError, match="not a positive number"):
        credentials_from_env({APP_ID_ENV: "abc", APP_PRIVATE_KEY_FILE_ENV: str(key_file)})


async def test_an_app_not_installed_on_the_org_names_the_fix(
    app_emu: tuple[RunningEmulator, dict[str, Any]],
) -> None:
    emu, _ = app_emu
    elsewhere = emu.admin.create_app(account="someone-else")
    with pytest.raises(AppAuthError) as caught:
        async with GitHubClient(
            GitHubScope(api_url=emu.url, org=emu.owner, repos=(emu.repo,)), credentials(elsewhere)
        ) as gh:
            await gh.list_runners()
    assert str(caught.value) == (
        f"GitHub App {elsewhere['app_id']} is not installed on the organization {emu.owner} "
        f"(GET /orgs/{emu.owner}/installation -> 404); install the App there (the App's "
        f"settings > Install App), or set ${APP_INSTALLATION_ID_ENV} / the block's "
        "app_installation_id"
    )


def test_emulator_app_endpoints_validate_against_the_openapi(
    app_emu: tuple[RunningEmulator, dict[str, Any]], validate: Validate
) -> None:
    emu, app = app_emu
    creds = credentials(app)
    signed = {"Authorization": f"Bearer {creds.jwt()}"}
    wrong = {"Authorization": f"Bearer {credentials(app, private_key=new_private_key()).jwt()}"}
    installation = app["installation_id"]
    with httpx.Client(base_url=emu.url, timeout=10) as api:
        calls = [
            (api.get(f"/repos/{emu.repo}/installation", headers=signed), 200),
            (api.get(f"/orgs/{emu.owner}/installation", headers=signed), 200),
            (api.post(f"/app/installations/{installation}/access_tokens", headers=signed), 201),
            (api.post(f"/app/installations/{installation}/access_tokens", headers=wrong), 401),
            (api.post("/app/installations/1/access_tokens", headers=signed), 404),
        ]
        for response, expect in calls:
            assert response.status_code == expect, response.text
            validate(response)
        assert calls[0][0].json()["id"] == installation
        token = calls[2][0].json()["token"]
        assert token.startswith("ghs_") and calls[2][0].json()["expires_at"].endswith("Z")
        runners = f"/repos/{emu.repo}/actions/runners"
        assert api.get(runners, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        emu.admin.expire_app_tokens()
        for bearer in (token, "ghs_never-issued"):
            refused = api.get(runners, headers={"Authorization": f"Bearer {bearer}"})
            # (the subset's runner listing declares no 401, so only its body is checked here)
            assert refused.status_code == 401 and refused.json()["message"] == "Bad credentials"
        emu.admin.suspend_installation(installation)
        suspended = api.post(f"/app/installations/{installation}/access_tokens", headers=signed)
        assert suspended.status_code == 403, suspended.text
        assert suspended.json()["message"] == "This installation has been suspended"
        validate(suspended)
        looked_up = api.get(f"/repos/{emu.repo}/installation", headers=signed)
        assert looked_up.json()["suspended_at"].endswith("Z")
        validate(looked_up)


def _cli(
    command: str, emu: RunningEmulator, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "GITHUB_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", command, "--api-url", emu.url, "--repo", emu.repo]
        + (["--once"] if command == "reconcile" else []),
        capture_output=True,
        text=True,
        timeout=90,
        cwd=REPO_ROOT,
        env={**base, **env},
    )


@pytest.mark.parametrize("command", ["reconcile", "status"])
def test_commands_with_a_wrong_app_key_fail_in_one_line(
    app_emu: tuple[RunningEmulator, dict[str, Any]], tmp_path: Path, command: str
) -> None:
    emu, app = app_emu
    wrong = tmp_path / "wrong.pem"
    wrong.write_text(new_private_key())
    out = _cli(command, emu, {APP_ID_ENV: str(app["app_id"]), APP_PRIVATE_KEY_FILE_ENV: str(wrong)})
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(  # the installation is looked up first, with the JWT
        f"error: GitHub App {app['app_id']}: GitHub refused the App's signed JWT (GET "
        f"/repos/{emu.repo}/installation -> 401: A JSON web token could not be decoded)"
    )
    assert "SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE" in lines[0]
    assert key_body(wrong.read_text()) not in out.stderr + out.stdout


def test_status_authenticates_as_the_app(
    app_emu: tuple[RunningEmulator, dict[str, Any]], tmp_path: Path
) -> None:
    emu, app = app_emu
    key = tmp_path / "app.pem"
    key.write_text(app["private_key"])
    env = {
        APP_ID_ENV: str(app["app_id"]),
        APP_PRIVATE_KEY_FILE_ENV: str(key),
        "PRIORITY_SCHEDULER_ENABLED": "true",
    }
    out = _cli("status", emu, {**env, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "cluster:a" in out.stdout
    assert emu.admin.app_stats()["tokens_issued"] >= 1


def test_emulator_app_command_prints_what_the_commands_need(
    app_emu: tuple[RunningEmulator, dict[str, Any]], tmp_path: Path
) -> None:
    emu, _ = app_emu
    key = tmp_path / "app.pem"
    command = [sys.executable, "-m", "slurmgate.cli", "emulator", "app", "--url", emu.url]
    out = subprocess.run(
        [*command, "--key-file", str(key)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    exports = dict(
        line.removeprefix("export ").split("=", 1)
        for line in out.stdout.splitlines()
        if line.startswith("export ")
    )
    assert set(exports) == {APP_ID_ENV, APP_PRIVATE_KEY_FILE_ENV}
    assert exports[APP_PRIVATE_KEY_FILE_ENV] == str(key) and key.stat().st_mode & 0o777 == 0o600
    assert "BEGIN" not in out.stdout  # the key went to the file only
    status = _cli("status", emu, {**exports, "COLUMNS": "200"})
    assert status.returncode == 0 and "cluster:a" in status.stdout, status.stderr
    again = subprocess.run(
        [*command, "--key-file", str(key)], capture_output=True, text=True, timeout=60, check=False
    )
    assert again.returncode == 2 and "exists; give a new path" in again.stderr
    narrow = tmp_path / "narrow.pem"
    bad = subprocess.run(
        [*command, "--key-file", str(narrow), "--permission", "actions=owner"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "permissions.actions must be one of read, write, admin" in (
        bad.stderr
    )
    assert not narrow.exists()
    made = subprocess.run(
        [*command, "--key-file", str(narrow), "--permission", "administration=read"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    narrowed = dict(
        line.removeprefix("export ").split("=", 1)
        for line in made.stdout.splitlines()
        if line.startswith("export ")
    )
    refused = _cli("status", emu, {**narrowed, "COLUMNS": "200"})
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines()[-1:] == [
        f"error: GitHub App {narrowed[APP_ID_ENV]}: GitHub answered 403 for GET /repos/"
        f"{emu.repo}/actions/runs (Resource not accessible by integration; GitHub accepts "
        "actions=read): the App lacks a permission; grant it the repository permissions "
        '"Administration: read and write" and "Actions: read" in the App\'s settings '
        "(Permissions & events), then approve them on its installation"
    ]


@pytest.mark.parametrize(
    ("status", "body", "transient"),
    [
        (201, {"token": "ghs_x\r\nX-Evil: 1", "expires_at": "2099-01-01T00:00:00Z"}, True),
        (201, {"token": "ghs_" + "x" * 5000, "expires_at": "2099-01-01T00:00:00Z"}, True),
        (201, {"token": "ghs_ok", "expires_at": "tomorrow"}, True),
        (201, {"token": "ghs_ok", "expires_at": "2099-01-01T00:00:00"}, True),  # no zone
        (201, ["not", "an", "object"], True),
        (502, {"message": "Bad Gateway"}, True),
        (403, {"message": "This installation has been suspended"}, False),
    ],
)
async def test_a_hostile_token_answer_is_refused_in_one_line(
    status: int, body: Any, transient: bool
) -> None:
    """What GitHub answers is believed only in shape: a token that could split a header, a huge
    one, an expiry that is no time, or a refusal, all fail as one line naming the App."""

    def github(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    provider = InstallationTokenProvider(
        GitHubAppCredentials(99, SecretStr(new_private_key()), 5),
        GitHubScope(api_url="https://api.github.com", repo="acme/gpu-ci"),
        transport=httpx.MockTransport(github),
    )
    with pytest.raises(AppAuthError) as caught:
        await provider.token()
    line = str(caught.value)
    assert line.startswith("GitHub App 99") and "\n" not in line and "X-Evil" not in line
    assert "/app/installations/5/access_tokens" in line
    assert caught.value.transient is transient


def test_a_key_pasted_on_one_line_still_loads() -> None:
    """The Prefect UI's secret field is one line: a pasted PEM arrives with its newlines gone."""
    pem = new_private_key()
    whole = GitHubAppCredentials(5, SecretStr(pem))
    for flattened in (pem.replace("\n", " "), pem.replace("\n", "\\n"), pem.replace("\n", "")):
        assert GitHubAppCredentials(5, SecretStr(flattened)).fingerprint == whole.fingerprint


async def test_an_app_without_the_runner_permission_is_told_which_to_grant() -> None:
    """GitHub answers 403 with the permission it accepts; the line names the App, that
    permission and what to grant in the App's settings."""
    with running_emulator({"a": 2}) as emu:
        app = emu.admin.create_app(permissions={"actions": "read", "metadata": "read"})
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        with pytest.raises(ScopeAccessError) as caught:
            await check_access(scope, credentials(app))
    line = str(caught.value)
    assert line == (
        f"GitHub App {app['app_id']}: GitHub answered 403 for GET /repos/{emu.repo}/actions/"
        "runners (Resource not accessible by integration; GitHub accepts administration=read): "
        'the App lacks a permission; grant it the repository permissions "Administration: read '
        'and write" and "Actions: read" in the App\'s settings (Permissions & events), then '
        "approve them on its installation"
    )


async def test_an_app_that_can_read_but_not_write_runners_leases_nothing() -> None:
    """Administration read only: the tick reads and plans, its first label write is refused
    (403 administration=write), and no runner keeps a label of ours."""
    with running_emulator({"a": 3}) as emu:
        app = emu.admin.create_app(
            permissions={"actions": "read", "administration": "read", "metadata": "read"}
        )
        emu.admin.add_job(job_labels(2, "ro"), duration_s=600)
        async with GitHubClient(
            GitHubScope(api_url=emu.url, repo=emu.repo), credentials(app)
        ) as gh:
            report = await reconcile_tick(direct_steps(gh), SETTINGS)
        assert report.admitted == 0 and len(report.failures) == 1
        assert "403" in report.failures[0] and "Resource not accessible" in report.failures[0]
        managed = ("ci-lease-", "ci-job-", "ci-attempt-", "nodes:")
        for runner in emu.admin.dump()["runners"]:
            assert not [x for x in runner["labels"] if x["name"].startswith(managed)]


async def test_an_app_without_actions_read_cannot_see_jobs_and_says_so() -> None:
    with running_emulator({"a": 2}) as emu:
        app = emu.admin.create_app(permissions={"administration": "write"})
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        assert await check_access(scope, credentials(app)) == 2  # the runners are readable
        async with GitHubClient(scope, credentials(app)) as gh:
            with pytest.raises(AuthError) as caught:
                await gh.get_job(1)
    assert caught.value.status == 403 and caught.value.accepted_permissions == "actions=read"
    line = explain(scope, caught.value, app["app_id"])
    assert line.startswith(f"GitHub App {app['app_id']}: GitHub answered 403 for GET ")
    assert "GitHub accepts actions=read" in line and '"Actions: read"' in line


async def test_a_suspended_installation_is_named_mid_tick(
    app_emu: tuple[RunningEmulator, dict[str, Any]],
) -> None:
    """Its token is refused (401); the refresh is refused too (403), in one line that says
    the installation is suspended and names the App."""
    emu, app = app_emu
    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    async with GitHubClient(scope, credentials(app)) as gh:
        await gh.list_runners(conditional=False)
        emu.admin.suspend_installation(app["installation_id"])
        with pytest.raises(AppAuthError) as caught:
            await gh.list_runners(conditional=False)
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"GitHub App {app['app_id']}: ")
    assert "This installation has been suspended" in line
    assert "check the installation is not suspended" in line


def test_a_hostile_accepted_permissions_header_is_not_repeated() -> None:
    """Only GitHub's shape (name=level sets) reaches an error line."""
    ok = httpx.Headers({"x-accepted-github-permissions": "issues=read; pull_requests=read"})
    assert accepted_permissions(ok) == "issues=read; pull_requests=read"
    for hostile in ("admin=write\x1b[2J", "run `rm -rf /`", "a=read," * 200, "a=owner"):
        headers = httpx.Headers({"x-accepted-github-permissions": hostile})
        assert accepted_permissions(headers) is None


def test_explain_for_an_app_names_the_installation_not_the_token() -> None:
    scope = GitHubScope(api_url="https://api.github.com", org="acme", repos=("acme/a",))
    path = "/orgs/acme/actions/runners"
    refused = AuthError("GET", path, 401, "Bad credentials", path=path)
    line = explain(scope, refused, 7)
    assert line.startswith("GitHub App 7: GitHub answered 401 for GET /orgs/acme/actions/runners")
    assert "suspended or removed" in line and "installation on acme" in line
    assert "token is not valid" not in line  # a person's-token diagnosis would mislead here
    assert "install the App on acme" in explain(
        scope, NotFound("GET", path, 404, "x", path=path), 7
    )
    assert "Self-hosted runners: read and write" in explain(
        scope, AuthError("GET", path, 403, "Resource not accessible by integration", path=path), 7
    )


def test_github_errors_survive_pickling() -> None:
    """Prefect may pickle a failed task's exception."""
    import pickle

    error = AuthError("GET", "/x", 403, "no", path="/x", accepted_permissions="actions=read")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is AuthError and str(again) == str(error)
    assert again.accepted_permissions == "actions=read" and again.status == 403


async def test_a_hostile_error_message_stays_one_printable_line() -> None:
    """GitHub's `message` reaches the error line; control characters in it do not."""

    def github(request: httpx.Request) -> httpx.Response:
        body = {"message": "Resource\nnot accessible\x1b[2J by integration\r\nX-Evil: 1"}
        return httpx.Response(403, json=body, headers={"x-accepted-github-permissions": "a=read"})

    scope = GitHubScope(api_url="https://api.github.com", repo="acme/gpu-ci")
    async with GitHubClient(scope, "token", transport=httpx.MockTransport(github)) as gh:
        with pytest.raises(AuthError) as caught:
            await gh.list_runners(conditional=False)
    line = explain(scope, caught.value, 7)
    assert line.isprintable() and "\x1b" not in line
    assert "Resource not accessible [2J by integration  X-Evil: 1" in line
    assert "GitHub accepts a=read" in line


async def test_requests_that_find_the_token_due_share_one_refresh() -> None:
    """Ten requests at once, no token yet: one access-token request, not ten."""
    minted = 0

    async def github(request: httpx.Request) -> httpx.Response:
        nonlocal minted
        minted += 1
        await asyncio.sleep(0.05)  # GitHub takes a moment: the others arrive meanwhile
        return httpx.Response(
            201, json={"token": f"ghs_t{minted}", "expires_at": "2099-01-01T00:00:00Z"}
        )

    provider = InstallationTokenProvider(
        GitHubAppCredentials(99, SecretStr(new_private_key()), 5),
        GitHubScope(api_url="https://api.github.com", repo="acme/gpu-ci"),
        transport=httpx.MockTransport(github),
    )
    tokens = await asyncio.gather(*(provider.token() for _ in range(10)))
    assert minted == 1 and provider.issued == 1
    assert {value for value, _ in tokens} == {"ghs_t1"}
    assert sum(fresh for _, fresh in tokens) == 1
