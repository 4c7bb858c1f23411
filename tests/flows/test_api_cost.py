"""API cost on the emulator's counters: N+1 writes per N-node lease, free idle ticks; release."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from flowcheck import assert_invariants, fleet, job_labels, jobs_by_id, managed_on, wait_for

from slurmgate.flows.reconcile import reconcile
from slurmgate.flows.release import release_lease

POST_LABELS = "POST /repos/{owner}/{repo}/actions/runners/{runner_id}/labels"


async def tick(emu: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    return await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)


def running(emu: Any, job_id: int) -> bool:
    return jobs_by_id(emu.admin.dump())[job_id]["status"] == "in_progress"


async def test_lease_costs_n_plus_1_writes_and_idle_ticks_are_free(
    emulator_factory, monkeypatch, controller_env
) -> None:
    emu = emulator_factory({"a": 12}, legacy=1)
    big = emu.admin.add_job(job_labels(10, token="big"), duration_s=600)["id"]
    emu.admin.reset_stats()
    summary = await tick(emu, monkeypatch)
    stats = emu.admin.stats()
    assert summary["admitted"] == 1
    assert stats["writes"] == 10 + 1 and stats["requests"][POST_LABELS] == 11
    assert summary["api_writes"] == 11
    wait_for(lambda: running(emu, big), what="10-node job running")

    one = emu.admin.add_job(["self-hosted", "ci-job-1.000-one", "ci-attempt-1"], 600)["id"]
    emu.admin.reset_stats()
    assert (await tick(emu, monkeypatch))["admitted"] == 1
    assert emu.admin.stats()["writes"] == 1 + 1
    wait_for(lambda: running(emu, one), what="1-node job running")

    await tick(emu, monkeypatch)  # sees the dispatches; from here nothing changes
    emu.admin.reset_stats()
    idle = await tick(emu, monkeypatch)
    stats = emu.admin.stats()
    assert stats["writes"] == 0 and stats["quota_used"] == 0
    assert stats["not_modified"] == stats["total"] > 0, stats
    assert idle["board_written"] is False  # the board did not change: no new artifact version

    # a fresh controller process reuses the ETag cache in SLURMGATE_STATE_DIR: still free
    assert list(Path(controller_env["SLURMGATE_STATE_DIR"]).glob("etags-*.json"))
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "GITHUB_TOKEN": emu.token, "PREFECT_API_URL": PREFECT_API_URL.value()}
    cli = [sys.executable, "-m", "slurmgate.cli", "reconcile", "--once"]
    done = subprocess.run(
        [*cli, "--api-url", emu.url, "--repo", emu.repo],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    stats = emu.admin.stats()
    assert stats["quota_used"] == 0 and stats["not_modified"] == stats["total"], stats

    # the CI job ends: release-lease frees its runners at once, with one DELETE per label
    emu.admin.reset_stats()
    result = await release_lease(job_id=big, scope_block=None, api_url=emu.url, repo=emu.repo)
    assert (result["runners"], result["removed"], result["already_gone"]) == (10, 13, 0)
    assert emu.admin.stats()["writes"] == 13
    assert big not in {j for j in _lease_jobs(emu)}
    assert len(managed_on(fleet(emu.admin.dump()))) == 1  # only the 1-node lease is left
    again = await release_lease(job_id=big, scope_block=None, api_url=emu.url, repo=emu.repo)
    assert again["runners"] == 0  # idempotent
    assert_invariants(emu.admin.dump())


def _lease_jobs(emu: Any) -> set[int]:
    from slurmgate.admission.model import leases_from_fleet

    leases, _ = leases_from_fleet(fleet(emu.admin.dump()))
    return {lease.job_id for lease in leases}
