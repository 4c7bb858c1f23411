"""Releasing a lease whose job is still queued races GitHub's dispatch: the emulator dispatches
the job while the tick's first label removal hangs, and the running job keeps its lease."""

from __future__ import annotations

import asyncio
import time

from slurmgate.admission.labels import LeaseLabel
from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

GATE = ("ci-attempt-1", "ci-job-1.000-race", "nodes:2")
# the lease below is two minutes old: past this limit, it is released as expired-while-queued
SETTINGS = AdmissionSettings(
    PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True, lease_max_queued_age_s=60
)


def _client(emu: RunningEmulator) -> GitHubClient:
    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    return GitHubClient(scope, emu.token, min_write_interval_s=0, backoff_base_s=0.02)


def _expired_lease(emu: RunningEmulator) -> tuple[int, str]:
    """A queued job whose lease (runners 1 and 2, anchor 1) waited too long: its anchor carries
    every gate label but is offline, so GitHub has not dispatched it yet."""
    job_id = emu.admin.add_job(["self-hosted", "cluster:a", *GATE], duration_s=600)["id"]
    lease = LeaseLabel(job_id, 1, int(time.time()) - 120, "r4ce00").render()
    emu.admin.set_runner_status(1, "offline")
    with emu.state.lock:
        emu.state.add_labels(emu.state.runners[1], [lease, *GATE])
        emu.state.add_labels(emu.state.runners[2], [lease])
    assert emu.job_placement(job_id) == ("queued", None)
    return job_id, lease


async def _when_write_hangs(emu: RunningEmulator, nth: int, then: object) -> None:
    """Wait for the tick's `nth` write to reach the emulator, then call `then()` (a thread)."""
    with emu.state.lock:
        target = emu.state.write_seq + nth
    while True:
        with emu.state.lock:
            if emu.state.write_seq >= target:
                break
        await asyncio.sleep(0.01)
    await asyncio.to_thread(then)  # type: ignore[arg-type]


async def test_a_job_dispatched_while_its_lease_is_released_keeps_the_lease() -> None:
    with running_emulator({"a": 3}) as emu:
        job_id, lease = _expired_lease(emu)
        # The first removal hangs without landing; meanwhile the anchor comes back online and
        # GitHub dispatches the job to it (the gate labels are all still there).
        emu.admin.fault("hang_nth_write", n=1, hang_s=0.5, applied=False)
        async with _client(emu) as client:
            dispatch = asyncio.create_task(
                _when_write_hangs(emu, 1, lambda: emu.admin.set_runner_status(1, "online"))
            )
            report = await reconcile_tick(direct_steps(client), SETTINGS)
            await dispatch
        assert emu.job_placement(job_id) == ("in_progress", 1)
        # the running job's tokens stay counted: the lease label stays on both runners
        assert report.released == 0 and report.kept_started == 1, report.failures
        assert lease in emu.runner_labels(1) and lease in emu.runner_labels(2)
        # its dispatch label went first and is not restored: the job runs and needs it no more
        assert "ci-job-1.000-race" not in emu.runner_labels(1)
        assert report.admitted == 0  # the pool is not over-admitted into the running lease


async def test_the_dispatch_label_goes_first_and_then_nothing_can_dispatch() -> None:
    with running_emulator({"a": 3}) as emu:
        job_id, lease = _expired_lease(emu)
        seen: dict[str, set[str]] = {}

        def look_then_come_online() -> None:
            seen["anchor"] = emu.runner_labels(1)
            emu.admin.set_runner_status(1, "online")

        # The first removal lands and its answer hangs; the anchor comes online meanwhile.
        emu.admin.fault("hang_nth_write", n=1, hang_s=0.5, applied=True)
        async with _client(emu) as client:
            watch = asyncio.create_task(_when_write_hangs(emu, 1, look_then_come_online))
            report = await reconcile_tick(direct_steps(client), SETTINGS)
            await watch
        # the first write took the job's unique ci-job label off the anchor, nothing else
        assert "ci-job-1.000-race" not in seen["anchor"]
        assert {lease, "ci-attempt-1", "nodes:2"} <= seen["anchor"]
        # so GitHub could not dispatch to the anchor when it came online, and the lease went
        assert report.released == 1 and report.kept_started == 0, report.failures
        assert lease not in emu.runner_labels(1) | emu.runner_labels(2)
        # the freed runners serve the same tick: the job is admitted again under a fresh lease
        assert report.admitted == 1
        assert emu.job_placement(job_id)[0] == "in_progress"
