"""The token never reaches a log; two controllers at once never over-admit."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from flowcheck import assert_invariants, fleet, job_labels, lease_of_job
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter
from prefect.logging.handlers import APILogHandler

from flows.reconcile import reconcile
from slurmgate.admission.labels import LeaseLabel
from slurmgate.admission.leases import admit_lease
from slurmgate.admission.model import Admit
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope

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
