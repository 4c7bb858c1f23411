"""Lease races the soak found, each pinned on the emulator: lost anchor answers, slow anchors,
late stamps and slow reads between two controllers."""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime

import pytest

from slurmgate.admission.batch_verify import BatchShare
from slurmgate.admission.labels import LeaseLabel
from slurmgate.admission.leases import (
    AdmitOutcome,
    AnchorDeadline,
    CompensationStack,
    LeaseConflict,
    LeaseLost,
    add_anchor_labels,
    add_lease_labels,
    admit_lease,
    verify_lease,
)
from slurmgate.admission.model import Admit, Snapshot
from slurmgate.admission.tick import TickSteps, reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

SETTINGS = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True)
GATE = ("ci-attempt-1", "ci-job-1.000-race", "nodes:2")


def _client(emu: RunningEmulator, **options: float) -> GitHubClient:
    return GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token, **options)  # type: ignore[arg-type]


def _queue_job(emu: RunningEmulator) -> int:
    return emu.admin.add_job(["self-hosted", "cluster:a", *GATE], duration_s=600)["id"]


def _admit(job_id: int, stamp: float) -> Admit:
    return Admit(
        job_id=job_id,
        attempt=1,
        pool="cluster:a",
        nodes=2,
        runner_ids=(1, 2),
        anchor_id=1,
        lease_label=LeaseLabel(job_id, 1, int(stamp)).render(),
        anchor_labels=GATE,
        priority="1.000",
        reason="test",
    )


async def test_an_anchor_whose_answer_was_lost_after_dispatch_keeps_its_lease() -> None:
    """The anchor write lands and GitHub dispatches the job, but the answer never arrives and
    the client gives up. Unwinding then would strip a running job's lease; it must stand."""
    with running_emulator({"a": 3}) as emu:
        job_id = _queue_job(emu)
        admit = _admit(job_id, time.time())
        # writes 1 and 2 are the lease labels, write 3 is the anchor: applied, answer too late
        emu.admin.fault("hang_nth_write", n=3, hang_s=1.0, applied=True)
        async with _client(emu, timeout_s=0.3, max_retries=0) as client:
            outcome = await admit_lease(client, admit, fleet_size=3)
        assert outcome.admitted, outcome.reason
        assert emu.job_placement(job_id) == ("in_progress", 1)
        assert {admit.lease_label, *GATE} <= emu.runner_labels(1)
        assert admit.lease_label in emu.runner_labels(2)


async def test_an_anchor_past_its_deadline_is_given_up_before_it_is_written() -> None:
    """Another controller may release a lease without an anchor once it is older than the
    orphan grace; a lease that old is rolled back instead of anchored."""
    with running_emulator({"a": 3}) as emu:
        job_id = _queue_job(emu)
        admit = _admit(job_id, time.time() - 25)
        async with _client(emu) as client:
            outcome = await admit_lease(client, admit, fleet_size=3)
        assert not outcome.admitted and "LeaseLost" in outcome.reason
        assert emu.job_placement(job_id) == ("queued", None)
        assert not any(
            name.startswith("ci-") for name in emu.runner_labels(1) | emu.runner_labels(2)
        )


async def test_an_anchor_write_held_by_a_rate_limit_is_abandoned_at_the_deadline() -> None:
    """A Retry-After longer than the time left would land the anchor after the grace."""
    with running_emulator({"a": 3}) as emu:
        job_id = _queue_job(emu)
        admit = _admit(job_id, time.time())
        async with _client(emu) as client:
            stack = CompensationStack()
            await add_lease_labels(client, admit, stack)
            verified = await verify_lease(client, admit, fleet_size=3)
            emu.admin.fault("rate_limit", method="POST", count=1, retry_after_s=3)
            started = time.monotonic()
            with pytest.raises(LeaseLost, match="past the 1s"):
                await add_anchor_labels(
                    client, admit, stack, verified, deadline=AnchorDeadline(within_s=1.0)
                )
            assert time.monotonic() - started < 2.5  # not the 3 s Retry-After
            await stack.unwind()
        assert emu.job_placement(job_id) == ("queued", None)
        assert not any(
            name.startswith("ci-") for name in emu.runner_labels(1) | emu.runner_labels(2)
        )


async def test_each_batch_is_stamped_when_it_starts_not_when_it_was_planned() -> None:
    """Batches of admissions run one after another; stamped at plan time, the last ones of a
    busy tick would start already older than the orphan grace. At a 4 s write pace two 2-node
    admissions (6 writes, 24 s) do not fit one batch's write budget: two batches."""
    clock = [1_800_000_000.0]

    def now() -> datetime:
        clock[0] += 20.0  # every look at the clock is 20 s later: a slow, busy tick
        return datetime.fromtimestamp(clock[0], UTC)

    with running_emulator({"a": 4}) as emu:
        first = emu.admin.add_job(
            ["self-hosted", "cluster:a", "nodes:2", "ci-job-2.000-one", "ci-attempt-1"], 600
        )["id"]
        second = emu.admin.add_job(
            ["self-hosted", "cluster:a", "nodes:2", "ci-job-1.000-two", "ci-attempt-1"], 600
        )["id"]
        async with _client(emu) as client:
            direct = direct_steps(client)
            planned_at: list[int] = []

            async def admit(planned: Admit, fleet_size: int, share: BatchShare) -> AdmitOutcome:
                assert share.verifier is None  # a batch of one reads on its own
                planned_at.append(LeaseLabel.parse(planned.lease_label).created_at)
                deadline = AnchorDeadline(clock=lambda: clock[0])
                return await admit_lease(client, planned, fleet_size=fleet_size, deadline=deadline)

            steps = TickSteps(direct.read_snapshot, direct.remove, admit, write_interval_s=4.0)
            report = await reconcile_tick(steps, SETTINGS, now=now)
        assert report.admitted == 2, report.failures
        planned = [LeaseLabel.parse(a.lease_label).created_at for a in report.decisions.admit]
        assert planned_at[0] > planned[0] and planned_at[1] > planned_at[0]
        assert emu.job_placement(first)[0] == emu.job_placement(second)[0] == "in_progress"


async def test_lease_ages_are_judged_from_when_the_read_began() -> None:
    """A slow read must not age another controller's lease past the orphan grace: the lease
    was seen without its anchor at some moment after the read began, not at plan time."""
    clock = [1_800_000_000.0]

    def now() -> datetime:
        return datetime.fromtimestamp(clock[0], UTC)

    with running_emulator({"a": 4}) as emu:
        job_id = _queue_job(emu)
        lease = LeaseLabel(job_id, 1, int(clock[0]) - 10).render()  # 10 s old, grace 30 s
        with emu.state.lock:
            emu.state.add_labels(emu.state.runners[3], [lease])
        async with _client(emu) as client:
            direct = direct_steps(client)

            async def slow_read() -> Snapshot:
                snapshot = await direct.read_snapshot()
                clock[0] += 40.0  # the read took 40 s (retries, Retry-After)
                return snapshot

            report = await reconcile_tick(
                TickSteps(slow_read, direct.remove, direct.admit), SETTINGS, now=now
            )
        assert report.released == 0
        assert lease in emu.runner_labels(3)


async def test_a_twin_admission_under_the_same_label_leaves_the_running_lease_alone() -> None:
    """Two controllers admitting one job in the same second write the same lease label. The
    one that finds the job already running must not unwind: its labels are the twin's too."""
    with running_emulator({"a": 3}) as emu:
        job_id = _queue_job(emu)
        admit = _admit(job_id, time.time())
        async with _client(emu) as client:
            first = await admit_lease(client, admit, fleet_size=3)
            twin = await admit_lease(client, admit, fleet_size=3)
        assert first.admitted
        assert not twin.admitted and twin.reason.startswith("AlreadyRunning") and not twin.undone
        assert emu.job_placement(job_id) == ("in_progress", 1)
        assert {admit.lease_label, *GATE} <= emu.runner_labels(1)
        assert admit.lease_label in emu.runner_labels(2)


async def test_a_lease_whose_anchor_lost_some_job_labels_is_released_and_readmitted() -> None:
    """A controller killed half-way through removing an anchor's labels leaves a lease whose
    anchor GitHub can never dispatch to; it must not hold its runners until the queued-age
    limit (an hour), but be released and the job admitted again in the same tick."""
    with running_emulator({"a": 3}) as emu:
        job_id = _queue_job(emu)
        lease = LeaseLabel(job_id, 1, int(time.time()) - 5).render()
        with emu.state.lock:
            emu.state.add_labels(emu.state.runners[1], [lease, "ci-attempt-1"])
            emu.state.add_labels(emu.state.runners[2], [lease])
        async with _client(emu) as client:
            report = await reconcile_tick(direct_steps(client), SETTINGS)
        assert report.released == 1 and report.admitted == 1, report.failures
        status, runner_id = emu.job_placement(job_id)
        assert status == "in_progress" and runner_id is not None
        assert lease not in emu.runner_labels(1) | emu.runner_labels(2)


async def test_the_second_to_verify_backs_off_even_when_it_is_older() -> None:
    """The verify-then-anchor race: controller A verified its lease before B's label landed, so
    A anchors. B then sees A's younger, still unanchored lease on a shared runner. Ranking by age
    would let B win too, and both would anchor on one runner; B must back off instead."""
    with running_emulator(pools={"a": 3}) as emu:
        now = time.time()
        job_a, job_b = _queue_job(emu), _queue_job(emu)
        lease_a = _admit(job_a, now)
        lease_b = dataclasses.replace(_admit(job_b, now - 5), runner_ids=(2, 3), anchor_id=3)
        async with _client(emu, min_write_interval_s=0) as a, _client(emu) as b:
            await add_lease_labels(a, lease_a, CompensationStack())
            await verify_lease(a, lease_a)  # A sees no competitor: it goes on to anchor
            stack_b = CompensationStack()
            await add_lease_labels(b, lease_b, stack_b)
            with pytest.raises(LeaseConflict, match="backs off"):
                await verify_lease(b, lease_b)  # B is older, and still must not proceed


async def test_a_lease_that_sees_its_job_anchored_under_a_twin_backs_off() -> None:
    """Two controllers admitted one job on disjoint runners. The second to verify reads the
    whole fleet, sees the first's anchor carrying the job, and unwinds rather than hold two
    more runners until the next tick releases them. An unanchored twin is not a reason: both
    would back off, and the planner keeps one of two committed leases next tick."""
    with running_emulator({"a": 4}) as emu:
        job_id = _queue_job(emu)
        now = time.time()
        first = dataclasses.replace(_admit(job_id, now - 2), runner_ids=(3, 4), anchor_id=3)
        second = _admit(job_id, now)  # runners 1 and 2, another stamp: another lease
        async with _client(emu, min_write_interval_s=0) as client:
            await add_lease_labels(client, first, CompensationStack())
            stack = CompensationStack()
            await add_lease_labels(client, second, stack)
            await verify_lease(client, second, fleet_size=4)  # the twin has no anchor yet
            await stack.unwind()
            assert (await admit_lease(client, first, fleet_size=4)).admitted
            assert emu.job_placement(job_id) == ("in_progress", 3)
            outcome = await admit_lease(client, second, fleet_size=4)
        assert not outcome.admitted and outcome.undone
        assert (
            "already anchored on runner" in outcome.reason and first.lease_label in outcome.reason
        )
        for runner_id in (1, 2):
            assert not {second.lease_label, *GATE} & emu.runner_labels(runner_id)
        assert {first.lease_label, *GATE} <= emu.runner_labels(3)
