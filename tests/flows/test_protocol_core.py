"""The core protocol without Prefect, on the emulator: idempotent steps, reverse undo, guards."""

from __future__ import annotations

import pytest
from flowcheck import fleet, managed_on

from slurmgate.admission.leases import (
    CompensationStack,
    LeaseConflict,
    UnmanagedLabelError,
    add_lease_labels,
    remove_labels,
    verify_lease,
)
from slurmgate.admission.model import Admit
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope


def admit_for(runner_ids: tuple[int, ...]) -> Admit:
    return Admit(
        job_id=7,
        attempt=1,
        pool="cluster:a",
        nodes=len(runner_ids),
        runner_ids=runner_ids,
        anchor_id=runner_ids[0],
        lease_label="ci-lease-j7-a1-t1800000000",
        anchor_labels=("ci-job-1.000-x", "ci-attempt-1", f"nodes:{len(runner_ids)}"),
        priority="1.000",
        reason="test",
    )


async def test_retried_label_step_resends_nothing_and_undo_runs_in_reverse(
    emulator_factory,
) -> None:
    emu = emulator_factory({"a": 4})
    admit = admit_for((1, 2, 3))
    stack = CompensationStack()
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), "t") as client:
        await add_lease_labels(client, admit, stack)
        emu.admin.reset_stats()
        await add_lease_labels(client, admit, stack)  # a retry after a step that did land
        assert emu.admin.stats()["writes"] == 0
        await verify_lease(client, admit)
        assert stack.pending == [
            (1, admit.lease_label),
            (2, admit.lease_label),
            (3, admit.lease_label),
        ]
        report = await stack.unwind()
    assert [runner for runner, _ in report.undone] == [3, 2, 1]
    assert report.failed == [] and len(stack) == 0
    assert managed_on(fleet(emu.admin.dump())) == {}


async def test_only_managed_labels_can_be_removed(emulator_factory) -> None:
    emu = emulator_factory({"a": 1})
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), "t") as client:
        emu.admin.reset_stats()
        with pytest.raises(UnmanagedLabelError, match="cluster:a"):
            await remove_labels(client, [(1, ["ci-lease-j1-a1-t1", "cluster:a"])])
        with pytest.raises(UnmanagedLabelError):
            CompensationStack().push_label_removal(client, 1, "gpu-h100")
        assert emu.admin.stats()["writes"] == 0  # refused before any request
        outcome = await remove_labels(client, [(1, ["ci-lease-j1-a1-t1"])])
    assert outcome.already_gone == ((1, "ci-lease-j1-a1-t1"),)  # 404 is success


async def test_large_fleet_verifies_by_reading_only_the_chosen_runners(emulator_factory) -> None:
    """250 runners are 3 list pages: a 2-runner lease reads its 2 runners, not the pages, and
    another lease on one of them is a conflict found in those same 2 reads."""
    emu = emulator_factory({"a": 250})
    admit = admit_for((1, 2))
    stack = CompensationStack()
    by_id = "GET /repos/{owner}/{repo}/actions/runners/{runner_id}"
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), "t") as client:
        await add_lease_labels(client, admit, stack)
        emu.admin.reset_stats()
        await verify_lease(client, admit, fleet_size=250)
        assert emu.admin.stats()["requests"] == {by_id: 2}

        await client.add_labels(2, ["ci-lease-j1-a1-t100"])  # an older lease, same runner
        emu.admin.reset_stats()
        with pytest.raises(LeaseConflict, match="ci-lease-j1-a1-t100"):
            await verify_lease(client, admit, fleet_size=250)
        assert emu.admin.stats()["requests"] == {by_id: 2}
        await stack.unwind()
