"""The core protocol without Prefect, on the emulator: idempotent steps, reverse undo, guards."""

from __future__ import annotations

import pytest
from flowcheck import fleet, managed_on

from slurmgate.admission.leases import (
    Admission,
    CompensationStack,
    LeaseConflict,
    LeaseSteps,
    UnmanagedLabelError,
    add_lease_labels,
    remove_labels,
    verify_lease,
)
from slurmgate.admission.model import Admit
from slurmgate.errors import ExternalError, is_transient
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


def lease_of(emu: object, admit: Admit) -> set[int]:
    """Runner ids carrying the admission's lease label."""
    labelled = managed_on(fleet(emu.admin.dump()))  # type: ignore[attr-defined]
    return {rid for rid, labels in labelled.items() if admit.lease_label in labels}


async def test_an_admission_resumes_after_a_transient_failure_and_rolls_nothing_back(
    emulator_factory,
) -> None:
    """The 2nd label write fails with a 502 while a run remains: the run raises with runner 1's
    label kept; the next run re-sends only what was not confirmed and anchors."""
    emu = emulator_factory({"a": 4})
    admit = admit_for((1, 2, 3))
    emu.admin.fault("fail_nth_write", n=2, status=502)
    admission = Admission(admit, retries=1)
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), "t", max_retries=0) as c:
        steps = LeaseSteps(c)
        with pytest.raises(ExternalError) as failed:
            await steps.run(admission)
        assert is_transient(failed.value)
        assert lease_of(emu, admit) == {1} and not admission.settled  # nothing rolled back
        emu.admin.reset_stats()
        outcome = await steps.run(admission)
    assert outcome.admitted and admission.settled and admission.runs == 2
    assert emu.admin.stats()["writes"] == 3  # runners 2 and 3, then the anchor: 1 is not re-sent
    assert lease_of(emu, admit) == {1, 2, 3}


async def test_an_admission_unwinds_a_transient_failure_on_its_last_run(emulator_factory) -> None:
    """Writes 2 and 4 fail with a 502 and one retry is allowed: the second failure is final and
    unwinds both runs' labels; `abandon` afterwards has nothing left to do."""
    emu = emulator_factory({"a": 4})
    admit = admit_for((1, 2, 3))
    emu.admin.fault("fail_nth_write", n=2, status=502)
    emu.admin.fault("fail_nth_write", n=4, status=502)
    admission = Admission(admit, retries=1)
    rollbacks: list[tuple[str, int]] = []
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), "t", max_retries=0) as c:
        steps = LeaseSteps(c)
        for _ in range(2):
            with pytest.raises(ExternalError):
                await steps.run(
                    admission,
                    on_rollback=lambda e, r: rollbacks.append((type(e).__name__, len(r.undone))),
                )
        assert admission.settled and managed_on(fleet(emu.admin.dump())) == {}
        assert rollbacks == [("TransientError", 3)]  # runners 3 (sent, failed), 2 and 1
        assert (await admission.abandon()).undone == []


async def test_abandoning_an_admission_between_runs_removes_what_it_wrote(emulator_factory) -> None:
    """The carrier gave up without a last run (a cancelled flow between retries): abandon
    unwinds, and the admission cannot run again."""
    emu = emulator_factory({"a": 4})
    admit = admit_for((1, 2, 3))
    emu.admin.fault("fail_nth_write", n=3, status=502)
    admission = Admission(admit, retries=3)
    async with GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), "t", max_retries=0) as c:
        with pytest.raises(ExternalError):
            await LeaseSteps(c).run(admission)
        assert lease_of(emu, admit) == {1, 2}
        report = await admission.abandon()
        # runner 3's undo was registered before its write was sent (it may have landed)
        assert sorted(report.undone) == [(r, admit.lease_label) for r in (1, 2, 3)]
        assert managed_on(fleet(emu.admin.dump())) == {}
        with pytest.raises(RuntimeError, match="already settled"):
            await LeaseSteps(c).run(admission)
