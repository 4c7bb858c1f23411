"""The admission loop's ticks: runs of the reconcile deployment, executed in this process, that
never overlap another run of the deployment, and whose failure does not end the loop."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

from flowcheck import job_labels

from slurmgate.admission.wakeups import WakeSettings
from slurmgate.flows.admission_loop import AdmissionLoop, run_deployment_in_process
from slurmgate.flows.reconcile import reconcile


async def apply_reconcile(emu: Any, monkeypatch: Any, name: str) -> UUID:
    """The reconcile deployment as `serve.py --events` builds it (inline scope, slot of one)."""
    from slurmgate.deployments import serve

    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    (deployment,) = await asyncio.to_thread(  # to_deployment is async inside an event loop
        serve.build_deployments,
        only="reconcile",
        reconcile_name=name,
        inline=serve.InlineScope(emu.url, emu.repo),
        schedule=False,
    )
    assert deployment.schedules in (None, [])
    deployment_id: UUID = await deployment.apply()
    return deployment_id


def anchored(emu: Any, token: str) -> bool:
    with emu.state.lock:
        return any(f"ci-job-1.000-{token}" in r.folded() for r in emu.state.runners.values())


async def test_a_loop_tick_is_a_deployment_run_and_waits_for_the_slot(
    emulator_factory, monkeypatch
) -> None:
    from prefect import get_client
    from prefect.states import Completed, Pending
    from prefect.utilities.engine import propose_state

    emu = emulator_factory({"a": 4})
    deployment_id = await apply_reconcile(emu, monkeypatch, "loop-slot")
    emu.admin.add_job(job_labels(1, token="first"), duration_s=600)

    # a manual run of the deployment holds the slot (as a worker's run would, from Pending on)
    async with get_client() as client:
        manual = await client.create_flow_run_from_deployment(deployment_id)
        assert (await propose_state(client, Pending(), flow_run_id=manual.id)).is_pending()
        assert await run_deployment_in_process(reconcile, deployment_id, "queued") == "CANCELLED"
        assert not anchored(emu, "first"), "a tick ran beside another run of the deployment"
        await propose_state(client, Completed(), flow_run_id=manual.id, force=True)

    # the slot is free: the tick runs here, admits, and is a run of the deployment
    assert await run_deployment_in_process(reconcile, deployment_id, "queued") == "COMPLETED"
    assert anchored(emu, "first")
    async with get_client() as client:
        runs = await client.read_flow_runs()
    ours = [r for r in runs if r.deployment_id == deployment_id]
    states = sorted(str(r.state_type.value) for r in ours if r.state_type is not None)
    assert states == ["CANCELLED", "COMPLETED", "COMPLETED"], states
    assert any("admission-loop" in r.tags for r in ours)


async def test_a_failed_tick_does_not_end_the_loop(emulator_factory, monkeypatch) -> None:
    """The first tick fails (GitHub answers 500s), the next wake still admits."""
    emu = emulator_factory({"a": 4})
    deployment_id = await apply_reconcile(emu, monkeypatch, "loop-fail")
    monkeypatch.setenv("SLURMGATE_REQUEST_RETRIES", "0")
    emu.admin.add_job(job_labels(1, token="later"), duration_s=600)
    emu.admin.fault("status", method="GET", path="*/actions/runners*", status=500, count=100)

    loop = AdmissionLoop(reconcile, deployment_id, WakeSettings(interval_s=None, min_gap_s=0))
    ticking = asyncio.create_task(loop.wakes.run(ticks=2))
    for _ in range(600):
        if loop.outcomes:
            break
        await asyncio.sleep(0.1)
    assert loop.outcomes == {"FAILED": 1}
    emu.admin.clear_faults()
    loop.wakes.wake("queued")
    await asyncio.wait_for(ticking, timeout=60)
    assert loop.outcomes == {"FAILED": 1, "COMPLETED": 1}
    assert anchored(emu, "later")
