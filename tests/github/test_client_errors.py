"""How the client meets GitHub's failure modes: rate limits, 5xx, timeouts, 4xx, auth."""

from __future__ import annotations

import socket
import time

import pytest

from slurmgate.github.client import GitHubClient
from slurmgate.github.errors import AuthError, RateLimited, TransientError, ValidationFailed
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

from .conftest import MakeClient

RUNNERS = "/repos/acme/gpu-ci/actions/runners"


async def test_exhausted_quota_waits_until_reset_then_succeeds(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client()
    emu.admin.set_quota(limit=2, window_s=1.2)
    await gh.list_runners(conditional=False)
    await gh.list_runners(conditional=False)
    assert gh.rate_limit is not None and gh.rate_limit.remaining == 0
    reset = gh.rate_limit.reset
    start = time.monotonic()
    runners = await gh.list_runners(conditional=False)
    waited = time.monotonic() - start
    assert len(runners) == 9
    assert time.time() >= reset  # it did not come back before the advertised reset
    assert waited >= 0.5
    assert gh.calls.retries == 1
    stats = emu.admin.stats()
    assert stats["statuses"]["403"] == 1


async def test_quota_reset_beyond_max_wait_raises_rate_limited(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client(max_wait_s=1.0)
    emu.admin.set_quota(limit=1, window_s=120)
    await gh.list_runners(conditional=False)
    start = time.monotonic()
    with pytest.raises(RateLimited) as info:
        await gh.get_runner(1)
    assert time.monotonic() - start < 1.0  # told the caller instead of sleeping two minutes
    assert info.value.status == 403
    assert 100 < info.value.retry_after_s <= 121
    requests = emu.admin.stats()["requests"]
    assert requests["GET /repos/{owner}/{repo}/actions/runners/{runner_id}"] == 1


async def test_retry_after_is_honoured(emu: RunningEmulator, make_client: MakeClient) -> None:
    gh = make_client()
    emu.admin.fault("rate_limit", path=RUNNERS, count=1, retry_after_s=1)
    start = time.monotonic()
    runners = await gh.list_runners()
    waited = time.monotonic() - start
    assert len(runners) == 9
    assert waited >= 1.0
    assert emu.admin.stats()["statuses"]["429"] == 1
    assert gh.calls.retries == 1


async def test_secondary_limit_without_headers_backs_off_exponentially(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client(secondary_wait_s=0.1)
    emu.admin.fault("rate_limit", path=RUNNERS, count=2, retry_after_s=None, status=403)
    start = time.monotonic()
    await gh.list_runners()
    waited = time.monotonic() - start
    assert waited >= 0.1 + 0.2  # 60 s in production, scaled: wait, then double
    assert emu.admin.stats()["statuses"]["403"] == 2


async def test_rate_limited_after_max_retries(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client(max_retries=2, secondary_wait_s=0.01)
    emu.admin.fault("rate_limit", path=RUNNERS, count=10, retry_after_s=None)
    with pytest.raises(RateLimited) as info:
        await gh.list_runners()
    assert info.value.status == 429 and info.value.retry_after_s > 0
    assert emu.admin.stats()["requests"]["GET /repos/{owner}/{repo}/actions/runners"] == 3


async def test_5xx_is_retried_then_succeeds(emu: RunningEmulator, make_client: MakeClient) -> None:
    gh = make_client()
    emu.admin.fault("status", method="GET", path=RUNNERS, count=2, status=502)
    assert len(await gh.list_runners()) == 9
    assert gh.calls.retries == 2
    assert emu.admin.stats()["statuses"]["502"] == 2


async def test_5xx_that_persists_raises_transient_error(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client(max_retries=3)
    emu.admin.fault("status", path=RUNNERS + "/*", count=100, status=500)
    with pytest.raises(TransientError) as info:
        await gh.get_runner(3)
    assert info.value.status == 500 and "after 4 attempts" in str(info.value)
    assert emu.admin.stats()["statuses"]["500"] == 4


async def test_422_is_never_retried(emu: RunningEmulator, make_client: MakeClient) -> None:
    gh = make_client()
    with pytest.raises(ValidationFailed) as info:
        await gh.add_labels(1, [])
    assert info.value.status == 422 and "1 to 100" in str(info.value)
    assert gh.calls.retries == 0
    assert emu.admin.stats()["writes"] == 1


async def test_timeout_is_retried(emu: RunningEmulator, make_client: MakeClient) -> None:
    gh = make_client(timeout_s=0.3)
    emu.admin.fault("latency", path=RUNNERS, ms=1500, count=1)
    assert len(await gh.list_runners()) == 9
    assert gh.calls.retries == 1


async def test_connection_refused_raises_transient_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    scope = GitHubScope(api_url=f"http://127.0.0.1:{port}", repo="acme/gpu-ci")
    async with GitHubClient(scope, "t", max_retries=1, backoff_base_s=0.01) as gh:
        with pytest.raises(TransientError) as info:
            await gh.list_runners()
    assert info.value.status is None and "ConnectError" in str(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None


async def test_wrong_token_is_an_auth_error_and_not_retried() -> None:
    with running_emulator(pools={"p": 1}, token="the-right-token") as emu:
        scope = GitHubScope(api_url=emu.url, repo=emu.repo)
        async with GitHubClient(scope, "the-wrong-token") as gh:
            with pytest.raises(AuthError) as info:
                await gh.list_runners()
            assert info.value.status == 401 and "Bad credentials" in str(info.value)
        async with GitHubClient(scope, "the-right-token") as gh:
            assert len(await gh.list_runners()) == 1
        assert emu.admin.stats()["statuses"] == {"401": 1, "200": 1}


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError, match="token is empty"):
        GitHubClient(GitHubScope(repo="acme/gpu-ci"), "  ")


async def test_failed_write_is_retried_and_applied_once(
    emu: RunningEmulator, make_client: MakeClient
) -> None:
    gh = make_client()
    emu.admin.fault("fail_nth_write", n=1, status=502)
    labels = await gh.add_labels(4, ["ci-lease-j9-a1-t1"])
    assert labels.count("ci-lease-j9-a1-t1") == 1
    assert emu.admin.stats()["writes"] == 2
