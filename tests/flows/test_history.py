"""Reconcile learns finished lease jobs' runtimes into the runtime-history block."""

from __future__ import annotations

from typing import Any

import pytest
from flowcheck import job_labels, jobs_by_id, wait_for

from slurmgate.admission.estimates import job_key
from slurmgate.blocks import AdmissionPolicyBlock, RuntimeHistoryBlock
from slurmgate.flows.reconcile import HISTORY_BLOCK, reconcile


async def tick(emu: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    return await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)


async def test_finished_lease_job_runtime_is_learned(emulator_factory, monkeypatch) -> None:
    await RuntimeHistoryBlock(history={}).asave(HISTORY_BLOCK, overwrite=True)
    emu = emulator_factory({"a": 4})
    job = emu.admin.add_job(job_labels(2, token="learn"), duration_s=1.0)["id"]
    assert (await tick(emu, monkeypatch))["admitted"] == 1
    wait_for(lambda: jobs_by_id(emu.admin.dump())[job]["status"] == "completed", what="done")

    summary = await tick(emu, monkeypatch)  # releases the lease and records the runtime
    assert summary["released"] == 1
    history = (await RuntimeHistoryBlock.aload(HISTORY_BLOCK)).runtime_history()
    name = jobs_by_id(emu.admin.dump())[job]["name"]
    runtimes = history.runtimes(job_key(name, 2))
    assert len(runtimes) == 1 and 0.5 <= runtimes[0] <= 30, runtimes

    await tick(emu, monkeypatch)  # the job is gone from the snapshot: nothing new, same record
    again = (await RuntimeHistoryBlock.aload(HISTORY_BLOCK)).runtime_history()
    assert again.runtimes(job_key(name, 2)) == runtimes


async def test_a_corrupt_history_is_ignored_not_fatal(emulator_factory, monkeypatch) -> None:
    await RuntimeHistoryBlock(history={"format": "bogus"}).asave(HISTORY_BLOCK, overwrite=True)
    emu = emulator_factory({"a": 2})
    emu.admin.add_job(job_labels(1, token="corrupt"), duration_s=30)
    summary = await tick(emu, monkeypatch)
    assert summary["admitted"] == 1 and summary["errors"] == 0
    await RuntimeHistoryBlock(history={}).asave(HISTORY_BLOCK, overwrite=True)


def test_policy_block_mirrors_every_planner_knob() -> None:
    from slurmgate.settings.admission import AdmissionSettings

    block = AdmissionPolicyBlock(
        priority_scheduler_enabled=True,
        node_slot_scheduler_enabled=True,
        policy="conservative",
        reservation_depth=4,
        timeout_overrides={"Agentic": 900},
    )
    settings = block.to_settings()
    assert (settings.policy, settings.reservation_depth, settings.node_slots) == (
        "conservative",
        4,
        True,
    )
    assert settings.timeout_overrides == {"agentic": 900}
    assert AdmissionPolicyBlock.from_settings(settings).to_settings() == settings
    knobs = set(AdmissionSettings.model_fields) - {
        "PRIORITY_SCHEDULER_ENABLED",
        "NODE_SLOT_SCHEDULER_ENABLED",
    }
    assert knobs <= set(AdmissionPolicyBlock.model_fields), knobs - set(
        AdmissionPolicyBlock.model_fields
    )
    with pytest.raises(ValueError, match="reservation_depth"):
        AdmissionPolicyBlock(reservation_depth=0)
