"""The reconcile tick in the core, over the emulator with the bare lease protocol (no Prefect).

The same function runs inside the `reconcile` flow (with retried tasks, one per lease), in
`slurmgate status` (read only) and in the benchmark's core arm.
"""

from __future__ import annotations

import pytest
from flowcheck import jobs_by_id, wait_for

from slurmgate.admission.batch_verify import BatchShare
from slurmgate.admission.estimates import RuntimeHistory
from slurmgate.admission.leases import AdmitOutcome
from slurmgate.admission.model import Admit
from slurmgate.admission.tick import TickFailed, TickSteps, reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

SETTINGS = AdmissionSettings(
    PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True, orphan_grace_s=0
)


def labels(nodes: int, token: str, score: str = "1.000") -> list[str]:
    return ["self-hosted", "cluster:a", f"nodes:{nodes}", f"ci-job-{score}-{token}", "ci-attempt-1"]


def steps(client: GitHubClient) -> TickSteps:
    return direct_steps(client)


def client_for(emu: RunningEmulator) -> GitHubClient:
    return GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token)


def leased_jobs(emu: RunningEmulator) -> dict[str, int]:
    """lease label -> runners holding it."""
    held: dict[str, int] = {}
    for runner in emu.admin.dump()["runners"]:
        for label in runner["labels"]:
            if label["name"].startswith("ci-lease-"):
                held[label["name"]] = held.get(label["name"], 0) + 1
    return held


async def test_a_tick_admits_in_order_and_reuses_what_it_released() -> None:
    with running_emulator({"a": 6}) as emu:
        big = emu.admin.add_job(labels(4, "big", "2.000"), duration_s=600)["id"]
        emu.admin.add_job(labels(4, "next"), duration_s=600)
        async with client_for(emu) as client:
            first = await reconcile_tick(steps(client), SETTINGS)
            assert (first.admitted, first.blocked, first.released) == (1, 1, 0)
            assert first.failures == []
            assert sorted(leased_jobs(emu).values()) == [4]

            emu.admin.complete_job(big)
            second = await reconcile_tick(steps(client), SETTINGS)
        # the release frees 4 runners, and the same tick re-reads and admits into them
        assert (second.released, second.admitted, second.blocked) == (1, 1, 0)
        assert sorted(leased_jobs(emu).values()) == [4]
        assert second.plan_s > 0 and second.fleet_size == 6


async def test_read_only_steps_plan_and_write_nothing() -> None:
    with running_emulator({"a": 4}) as emu:
        emu.admin.add_job(labels(2, "only-read"), duration_s=600)
        emu.admin.reset_stats()
        async with client_for(emu) as client:
            report = await reconcile_tick(direct_steps(client, read_only=True), SETTINGS)
        assert [a.nodes for a in report.decisions.admit] == [2]  # what it would do
        assert report.admitted == 0 and emu.admin.stats()["writes"] == 0
        assert leased_jobs(emu) == {}


async def test_a_failed_admission_is_collected_and_the_rest_go_on() -> None:
    with running_emulator({"a": 4}) as emu:
        emu.admin.add_job(labels(1, "one", "3.000"), duration_s=600)
        emu.admin.add_job(labels(1, "two", "2.000"), duration_s=600)
        async with client_for(emu) as client:
            real = steps(client)
            calls: list[int] = []

            async def flaky(a: Admit, fleet_size: int, share: BatchShare) -> AdmitOutcome:
                calls.append(a.job_id)
                if len(calls) == 1:
                    raise TimeoutError("GitHub did not answer")
                assert real.admit is not None
                return await real.admit(a, fleet_size, share)

            report = await reconcile_tick(
                TickSteps(real.read_snapshot, real.remove, flaky), SETTINGS
            )
    assert len(calls) == 2 and report.admitted == 1
    assert len(report.failures) == 1 and "TimeoutError: GitHub did not answer" in report.failures[0]
    with pytest.raises(TickFailed, match="1 decision"):
        report.raise_for_failures()


async def test_the_tick_learns_finished_runtimes_into_the_history() -> None:
    with running_emulator({"a": 2}) as emu:
        job = emu.admin.add_job(labels(1, "learn"), duration_s=1.5)["id"]
        history = RuntimeHistory()
        async with client_for(emu) as client:
            await reconcile_tick(steps(client), SETTINGS, history=history)
            done = lambda: jobs_by_id(emu.admin.dump())[job]["status"] == "completed"  # noqa: E731
            wait_for(done, what="the job ran on its anchor and completed")
            report = await reconcile_tick(steps(client), SETTINGS, history=history)
    assert report.runtimes_learned == 1 and report.released == 1
    assert [len(runs) for runs in history.records.values()] == [1]
