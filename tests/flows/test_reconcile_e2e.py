"""End to end on the emulator: the reconcile flow admits, blocks, releases and dispatches."""

from __future__ import annotations

from typing import Any

import pytest
from flowcheck import (
    assert_invariants,
    fleet,
    job_labels,
    jobs_by_id,
    lease_of_job,
    managed_on,
    wait_for,
)
from prefect.artifacts import Artifact

from slurmgate.admission.metrics import METRICS
from slurmgate.flows.reconcile import BOARD_KEY, reconcile


async def tick(emu: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    return await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)


def admissions_recorded() -> float:
    return (
        METRICS.registry.get_sample_value("slurmgate_admissions_total", {"pool": "cluster:a"}) or 0
    )


def anchor_of(dump: dict[str, Any], job_id: int) -> int:
    holders = lease_of_job(fleet(dump), job_id)
    anchors = [r.id for r in fleet(dump) if r.id in holders and r.managed_job_labels()]
    assert len(anchors) == 1, f"job {job_id}: anchors {anchors} among {holders}"
    return anchors[0]


async def test_seed_scenario_backfill_then_release(emulator_factory, monkeypatch) -> None:
    """18 runners: 10 runs; 9 and 8 queue -> 8 admitted, 9 blocked; 10 ends -> 9 admitted."""
    emu = emulator_factory({"a": 18})
    j10 = emu.admin.add_job(job_labels(10, token="ten"), duration_s=600)["id"]
    admitted_before = admissions_recorded()

    summary = await tick(emu, monkeypatch)
    assert summary["admitted"] == 1 and summary["errors"] == 0
    dump = emu.admin.dump()
    assert len(lease_of_job(fleet(dump), j10)) == 10
    # the dispatch really happens: GitHub (the emulator) hands the job to its anchor
    wait_for(lambda: jobs_by_id(emu.admin.dump())[j10]["status"] == "in_progress", what="dispatch")
    dump = emu.admin.dump()
    assert jobs_by_id(dump)[j10]["runner_id"] == anchor_of(dump, j10)
    assert_invariants(dump)

    j9 = emu.admin.add_job(job_labels(9, token="nine"), duration_s=600)["id"]
    j8 = emu.admin.add_job(job_labels(8, token="eight"), duration_s=600)["id"]
    summary = await tick(emu, monkeypatch)
    assert (summary["admitted"], summary["blocked"]) == (1, 1)
    dump = emu.admin.dump()
    assert len(lease_of_job(fleet(dump), j8)) == 8
    assert lease_of_job(fleet(dump), j9) == []
    assert set(lease_of_job(fleet(dump), j8)).isdisjoint(lease_of_job(fleet(dump), j10))
    wait_for(lambda: jobs_by_id(emu.admin.dump())[j8]["status"] == "in_progress", what="j8")
    assert jobs_by_id(emu.admin.dump())[j9]["status"] == "queued"
    assert_invariants(emu.admin.dump())

    # the board says why the 9 waits
    board = await Artifact.aget(BOARD_KEY)
    assert board is not None and f"job {j9} (9n): no-free-capacity" in str(board.data)

    emu.admin.complete_job(j10)
    summary = await tick(emu, monkeypatch)
    assert (summary["released"], summary["admitted"], summary["blocked"]) == (1, 1, 0)
    dump = emu.admin.dump()
    assert lease_of_job(fleet(dump), j10) == []
    assert len(lease_of_job(fleet(dump), j9)) == 9
    assert len(lease_of_job(fleet(dump), j8)) == 8
    wait_for(lambda: jobs_by_id(emu.admin.dump())[j9]["status"] == "in_progress", what="j9")
    assert_invariants(emu.admin.dump())
    # the flow recorded each tick into the process's metrics (what serve.py --metrics-port serves)
    assert admissions_recorded() - admitted_before == 3


async def test_equal_scores_queued_together_admit_8_and_9(emulator_factory, monkeypatch) -> None:
    emu = emulator_factory({"a": 18})
    ids = {
        n: emu.admin.add_job(job_labels(n, token=f"n{n}"), duration_s=600)["id"] for n in (10, 9, 8)
    }
    summary = await tick(emu, monkeypatch)
    assert (summary["admitted"], summary["blocked"]) == (2, 1)
    runners = fleet(emu.admin.dump())
    assert len(lease_of_job(runners, ids[9])) == 9
    assert len(lease_of_job(runners, ids[8])) == 8
    assert lease_of_job(runners, ids[10]) == []
    assert_invariants(emu.admin.dump())


async def test_running_lease_is_kept_and_bad_input_is_skipped(
    emulator_factory, monkeypatch
) -> None:
    """A running lease survives later ticks and a higher-priority job; a malformed nodes: label
    is reported and skipped while the jobs behind it are admitted."""
    emu = emulator_factory({"a": 12})
    running = emu.admin.add_job(job_labels(8, token="run"), duration_s=600)["id"]
    assert (await tick(emu, monkeypatch))["admitted"] == 1
    wait_for(lambda: jobs_by_id(emu.admin.dump())[running]["status"] == "in_progress", what="run")
    held = lease_of_job(fleet(emu.admin.dump()), running)

    urgent = emu.admin.add_job(job_labels(12, score="9.000", token="urgent"), duration_s=600)["id"]
    broken = emu.admin.add_job(job_labels("abc", token="broken"), duration_s=600)["id"]
    small = emu.admin.add_job(job_labels(4, token="small"), duration_s=600)["id"]
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    summary = await tick(emu, monkeypatch)
    assert summary["admitted"] == 1 and summary["blocked"] == 2 and summary["errors"] == 0
    runners = fleet(emu.admin.dump())
    assert lease_of_job(runners, running) == held  # never preempted
    assert lease_of_job(runners, urgent) == []
    assert lease_of_job(runners, broken) == []
    assert len(lease_of_job(runners, small)) == 4
    board = await Artifact.aget(BOARD_KEY)
    assert board is not None and f"job {broken} (?n): bad-input" in str(board.data)
    assert_invariants(emu.admin.dump())


async def test_legacy_runners_take_one_node_jobs_only(emulator_factory, monkeypatch) -> None:
    emu = emulator_factory({}, legacy=3)
    one = emu.admin.add_job(["self-hosted", "ci-job-1.000-one", "ci-attempt-1"], 600)["id"]
    two = emu.admin.add_job(["self-hosted", "ci-job-2.000-two", "ci-attempt-1", "nodes:2"], 600)[
        "id"
    ]
    summary = await tick(emu, monkeypatch)
    assert (summary["admitted"], summary["blocked"]) == (1, 1)
    wait_for(lambda: jobs_by_id(emu.admin.dump())[one]["status"] == "in_progress", what="legacy")
    dump = emu.admin.dump()
    assert len(lease_of_job(fleet(dump), one)) == 1
    assert jobs_by_id(dump)[one]["runner_id"] == anchor_of(dump, one)
    assert jobs_by_id(dump)[two]["status"] == "queued"
    assert len(managed_on(fleet(dump))) == 1
    assert_invariants(dump)
