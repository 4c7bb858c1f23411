"""The token, and a GitHub App's key, JWT and installation tokens, never reach a log, a state,
a parameter or an artifact; two controllers at once never over-admit."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from flowcheck import assert_invariants, fleet, job_labels, lease_of_job
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
)
from prefect.logging.handlers import APILogHandler

from slurmgate.admission.labels import LeaseLabel
from slurmgate.admission.leases import admit_lease
from slurmgate.admission.model import Admit
from slurmgate.flows.reconcile import reconcile
from slurmgate.github.app_auth import APP_ID_ENV, APP_PRIVATE_KEY_ENV
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.apps import new_private_key

TOKEN = "ghs_SLURMGATEsecretTOKEN0123456789"
WRONG = "ghs_WRONGsecretTOKEN9876543210abc"


async def api_logs(flow_run_ids: list[Any]) -> str:
    await APILogHandler.aflush()
    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id={"any_": flow_run_ids}), limit=200
        )
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids))
        )
    return "\n".join(log.message for log in logs) + "\n".join(str(r.parameters) for r in runs)


async def test_token_never_logged_even_when_requests_fail(
    emulator_factory, monkeypatch, caplog, capfd
) -> None:
    caplog.set_level(logging.DEBUG)
    emu = emulator_factory({"a": 12}, token=TOKEN)
    emu.admin.add_job(job_labels(4), duration_s=600)
    emu.admin.fault("fail_nth_write", n=2, status=422)

    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    failed = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    monkeypatch.setenv("GITHUB_TOKEN", WRONG)  # GitHub answers 401 to every request
    denied = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    assert failed.is_failed() and denied.is_failed()

    ids = [failed.state_details.flow_run_id, denied.state_details.flow_run_id]
    out, err = capfd.readouterr()
    stored = await api_logs(ids)
    assert "ValidationFailed" in stored and "AuthError" in stored  # the API kept the failures
    text = "\n".join([out, err, caplog.text, stored])
    # the failures were logged (so this text is the right haystack) ...
    assert "Injected write fault" in text and "401" in text
    # ... and neither token is in it
    assert TOKEN not in text and WRONG not in text
    assert TOKEN[8:24] not in text and WRONG[8:24] not in text


async def prefect_holds(flow_run_ids: list[Any]) -> str:
    """The logs, parameters, state messages and artifacts Prefect keeps of these flow runs."""
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids))
        )
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids))
        )
    states = "\n".join(r.state.message or "" for r in runs if r.state is not None)
    shown = "\n".join(f"{a.key} {a.description} {a.data}" for a in artifacts)
    return "\n".join([await api_logs(flow_run_ids), states, shown])


def pem_body(pem: str) -> str:
    return "".join(line for line in pem.splitlines() if "-----" not in line)


async def test_app_key_jwt_and_tokens_never_reach_prefect_or_the_output(
    emulator_factory, monkeypatch, caplog, capfd
) -> None:
    """Ticks as a GitHub App: one admits, one has its token expire mid-tick (a 401, a refresh,
    the retry), one signs with the wrong key and fails naming the App."""
    caplog.set_level(logging.DEBUG)
    emu = emulator_factory({"a": 6})
    app = emu.admin.create_app()
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    monkeypatch.setenv(APP_ID_ENV, str(app["app_id"]))
    monkeypatch.setenv(APP_PRIVATE_KEY_ENV, app["private_key"])
    emu.admin.add_job(job_labels(2, token="first"), duration_s=600)
    first = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    emu.admin.expire_app_tokens(after_requests=2)
    emu.admin.add_job(job_labels(2, token="second"), duration_s=600)
    second = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    wrong_key = new_private_key()
    monkeypatch.setenv(APP_PRIVATE_KEY_ENV, wrong_key)
    wrong = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    assert first.is_completed() and second.is_completed() and wrong.is_failed()
    assert (await first.result())["admitted"] == (await second.result())["admitted"] == 1
    stats = emu.admin.app_stats()
    assert stats["tokens_issued"] == 2 and stats["tokens_refused"] >= 1  # refreshed mid-tick
    assert stats["jwts_refused"] >= 1  # the wrong key's

    ids = [s.state_details.flow_run_id for s in (first, second, wrong)]
    out, err = capfd.readouterr()
    text = "\n".join([out, err, caplog.text, await prefect_holds(ids)])
    # the right haystack: the refresh, the refusal naming the App, and the board artifact
    assert "refreshing it" in text
    assert f"GitHub App {app['app_id']}: GitHub refused the App's signed JWT" in text
    assert "slurmgate-pool-board" in text
    tokens = list(emu.state.apps.tokens)
    assert len(tokens) == 2
    for secret in [*tokens, pem_body(app["private_key"]), pem_body(wrong_key)]:
        assert secret not in text and secret[8:40] not in text  # nor a piece of one
    assert "eyJ" not in text  # every JWT (and its header) starts so


async def test_an_app_without_actions_read_fails_the_tick_in_one_line(
    emulator_factory, monkeypatch
) -> None:
    """The flow run's failure says what the CLI would: the App, the request, GitHub's accepted
    permission and what to grant, with no traceback of the read in its state message."""
    emu = emulator_factory({"a": 2})
    app = emu.admin.create_app(permissions={"administration": "write", "metadata": "read"})
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    monkeypatch.setenv(APP_ID_ENV, str(app["app_id"]))
    monkeypatch.setenv(APP_PRIVATE_KEY_ENV, app["private_key"])
    emu.admin.add_job(job_labels(2, token="hidden"), duration_s=600)
    state = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    assert state.is_failed()
    message = state.message or ""
    assert f"GitHub App {app['app_id']}: GitHub answered 403 for GET /repos/{emu.repo}/" in message
    assert "GitHub accepts actions=read" in message and '"Actions: read"' in message
    assert "Traceback" not in message


async def test_two_reconcile_flows_at_once_never_over_admit(emulator_factory, monkeypatch) -> None:
    """The deployment's concurrency limit should prevent this; if it happens anyway, the
    verification (whoever sees another lease backs off) keeps the fleet consistent."""
    monkeypatch.setenv("SLURMGATE_ORPHAN_GRACE_S", "30")
    monkeypatch.setenv("SLURMGATE_MIN_WRITE_INTERVAL_S", "0.01")
    monkeypatch.setenv("GITHUB_TOKEN", "any")
    emu = emulator_factory({"a": 18})
    ids = [emu.admin.add_job(job_labels(n, token=f"n{n}"), 600)["id"] for n in (10, 9, 8)]

    results = await asyncio.gather(
        *(reconcile(scope_block=None, api_url=emu.url, repo=emu.repo) for _ in range(2)),
        return_exceptions=True,
    )
    for result in results:
        assert not isinstance(result, BaseException), result
    assert_invariants(emu.admin.dump())
    runners = fleet(emu.admin.dump())
    leased = sum(len(lease_of_job(runners, job_id)) for job_id in ids)
    assert leased <= 18
    # Colliding admissions back off (both may); the next tick admits what fits.
    await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)
    assert_invariants(emu.admin.dump())
    runners = fleet(emu.admin.dump())
    holding = [job_id for job_id in ids if lease_of_job(runners, job_id)]
    assert len(holding) == 2, holding  # two of the three fit in 18 runners, never three
    assert sum(len(lease_of_job(runners, job_id)) for job_id in holding) <= 18


async def test_concurrent_protocols_on_shared_runners_never_both_win(emulator_factory) -> None:
    """Two admissions racing for runners 6..10: at most one keeps its lease (GitHub has no
    compare-and-swap, so whoever sees the other backs off; both may), a loser undoes only its
    own labels, and the runners are free for the next tick."""
    emu = emulator_factory({"a": 15})
    first = emu.admin.add_job(job_labels(10, token="first"), 600)["id"]
    second = emu.admin.add_job(job_labels(10, token="second"), 600)["id"]

    def admit(job_id: int, token: str, runner_ids: range, created: int) -> Admit:
        return Admit(
            job_id=job_id,
            attempt=1,
            pool="cluster:a",
            nodes=10,
            runner_ids=tuple(runner_ids),
            anchor_id=runner_ids[0],
            lease_label=LeaseLabel(job_id, 1, created).render(),
            anchor_labels=(f"ci-job-1.000-{token}", "ci-attempt-1", "nodes:10"),
            priority="1.000",
            reason="test",
        )

    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    async with GitHubClient(scope, "t") as a, GitHubClient(scope, "t") as b:
        outcomes = await asyncio.gather(
            admit_lease(a, admit(first, "first", range(1, 11), 1_800_000_000)),
            admit_lease(b, admit(second, "second", range(6, 16), 1_800_000_001)),
        )
    assert sum(o.admitted for o in outcomes) <= 1, outcomes
    assert_invariants(emu.admin.dump())
    runners = fleet(emu.admin.dump())
    for outcome in outcomes:
        if outcome.admitted:
            assert len(lease_of_job(runners, outcome.job_id)) == 10
        else:
            assert "LeaseConflict" in outcome.reason or "LeaseLost" in outcome.reason
            assert lease_of_job(runners, outcome.job_id) == []
