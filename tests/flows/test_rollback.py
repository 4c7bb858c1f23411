"""Partial-write rollback: a failed label write undoes exactly this attempt; retries do not."""

from __future__ import annotations

from typing import Any

import pytest
from flowcheck import assert_invariants, fleet, job_labels, jobs_by_id, managed_on, wait_for

from slurmgate.admission.tick import TickFailed
from slurmgate.flows.reconcile import reconcile

NODES = 10
WRITES = NODES + 1  # one POST per runner, then one POST for the anchor


async def tick(emu: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    return await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)


async def admitted_normally(emu: Any, job_id: int, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = await tick(emu, monkeypatch)
    assert (summary["admitted"], summary["errors"]) == (1, 0)
    wait_for(lambda: jobs_by_id(emu.admin.dump())[job_id]["status"] == "in_progress", what="run")
    assert_invariants(emu.admin.dump())


@pytest.mark.parametrize("k", range(1, WRITES + 1))
async def test_kth_write_rejected_leaves_no_label(k, emulator_factory, monkeypatch) -> None:
    """A 422 (never retried) on write k of a 10-node lease: the tick fails, nothing remains."""
    emu = emulator_factory({})
    # the first runner carries a label of its own that must survive every rollback
    emu.admin.add_runner("a-rack7", ["cluster:a", "rack-7"])
    for i in range(11):
        emu.admin.add_runner(f"a-{i:02d}", ["cluster:a"])
    job_id = emu.admin.add_job(job_labels(NODES), duration_s=600)["id"]
    emu.admin.fault("fail_nth_write", n=k, status=422)
    emu.admin.reset_stats()

    with pytest.raises(TickFailed, match="ValidationFailed"):
        await tick(emu, monkeypatch)

    dump = emu.admin.dump()
    assert managed_on(fleet(dump)) == {}, f"labels of the failed attempt remain after write {k}"
    assert jobs_by_id(dump)[job_id]["status"] == "queued"
    posts = emu.admin.stats()["requests"].get(
        "POST /repos/{owner}/{repo}/actions/runners/{runner_id}/labels", 0
    )
    assert posts == k, "a 4xx must not be retried, and no write may follow it"
    # compensation removed only managed labels: the runner's own label is still there
    rack7 = next(r for r in fleet(dump) if r.name == "a-rack7")
    assert "rack-7" in rack7.folded

    await admitted_normally(emu, job_id, monkeypatch)
    assert "rack-7" in next(r for r in fleet(emu.admin.dump()) if r.name == "a-rack7").folded


@pytest.mark.parametrize("k", [1, 6, WRITES])
async def test_transient_failure_is_retried_without_rollback(
    k, emulator_factory, monkeypatch
) -> None:
    """A 502 on write k with no client-level retries: the Prefect task retry re-sends it and the
    lease completes with exactly its labels (a Prefect transaction would have rolled back)."""
    monkeypatch.setenv("SLURMGATE_REQUEST_RETRIES", "0")
    emu = emulator_factory({"a": 12})
    job_id = emu.admin.add_job(job_labels(NODES), duration_s=600)["id"]
    emu.admin.fault("fail_nth_write", n=k, status=502)
    emu.admin.reset_stats()

    summary = await tick(emu, monkeypatch)
    assert (summary["admitted"], summary["rolled_back"], summary["errors"]) == (1, 0, 0)
    assert emu.admin.stats()["writes"] == WRITES + 1  # exactly one repeated write
    wait_for(lambda: jobs_by_id(emu.admin.dump())[job_id]["status"] == "in_progress", what="run")
    dump = emu.admin.dump()
    labelled = managed_on(fleet(dump))
    assert len(labelled) == NODES
    assert_invariants(dump)


async def test_retried_write_is_compensated_when_a_later_step_fails(
    emulator_factory, monkeypatch
) -> None:
    """Retries and compensation together: write 3 fails once (502) and passes on retry, then the
    anchor write is rejected (422): every label of the attempt, the retried one too, is removed."""
    monkeypatch.setenv("SLURMGATE_REQUEST_RETRIES", "0")
    emu = emulator_factory({"a": 12})
    job_id = emu.admin.add_job(job_labels(NODES), duration_s=600)["id"]
    emu.admin.fault("fail_nth_write", n=3, status=502)
    emu.admin.fault("fail_nth_write", n=WRITES + 1, status=422)  # the anchor, after one retry

    with pytest.raises(TickFailed, match="ValidationFailed"):
        await tick(emu, monkeypatch)
    assert managed_on(fleet(emu.admin.dump())) == {}
    await admitted_normally(emu, job_id, monkeypatch)
