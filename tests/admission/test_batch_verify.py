"""One fresh read verifies a batch of admissions: batch sizing, the round that waits for every
member's labels, members that leave or come late, and a busy tick's reads on the emulator."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from flowcheck import wait_for
from hypothesis import given
from hypothesis import strategies as st

from slurmgate.admission.batch_verify import BatchVerification, verification_batches
from slurmgate.admission.labels import LeaseLabel
from slurmgate.admission.leases import ANCHOR_WITHIN_S, admit_lease, anchor_window_s
from slurmgate.admission.model import Admit
from slurmgate.admission.tick import reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.errors import NotFoundError
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

SETTINGS = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True, NODE_SLOT_SCHEDULER_ENABLED=True)
LIST = "GET /repos/{owner}/{repo}/actions/runners"
ONE = "GET /repos/{owner}/{repo}/actions/runners/{runner_id}"


def admit(job_id: int, runners: tuple[int, ...], name: str = "") -> Admit:
    """The admission of job `job_id` queued by `queue(emu, name, ...)` (its labels' name)."""
    return Admit(
        job_id=job_id,
        attempt=1,
        pool="cluster:a",
        nodes=len(runners),
        runner_ids=runners,
        anchor_id=runners[0],
        lease_label=LeaseLabel(job_id, 1, int(time.time())).render(),
        anchor_labels=("ci-attempt-1", f"ci-job-1.000-{name or job_id}", f"nodes:{len(runners)}"),
        priority="1.000",
        reason="test",
    )


def queue(emu: RunningEmulator, name: str, nodes: int) -> int:
    labels = ["self-hosted", "cluster:a", f"nodes:{nodes}", f"ci-job-1.000-{name}", "ci-attempt-1"]
    return int(emu.admin.add_job(labels, duration_s=600)["id"])


def two_leases(emu: RunningEmulator) -> tuple[Admit, Admit]:
    """Two queued 2-node jobs and their admissions, on runners 1-2 and 3-4."""
    return admit(queue(emu, "b1", 2), (1, 2), "b1"), admit(queue(emu, "b2", 2), (3, 4), "b2")


def client_for(emu: RunningEmulator) -> GitHubClient:
    return GitHubClient(GitHubScope(api_url=emu.url, repo=emu.repo), emu.token)  # type: ignore[arg-type]


def reads(emu: RunningEmulator) -> dict[str, int]:
    requests = emu.admin.stats()["requests"]
    return {key: int(requests.get(key, 0)) for key in (LIST, ONE)}


# ---- sizing ---------------------------------------------------------------------------------


def test_batches_fit_the_write_budget_at_the_clients_pace() -> None:
    fours = [admit(i, tuple(range(4 * i + 1, 4 * i + 5))) for i in range(5)]
    # 1 s apart, GitHub's pace: 4 + 1 writes each, 10 s of writes a batch -> pairs
    assert [len(b) for b in verification_batches(fours, 1.0)] == [2, 2, 1]
    # unpaced (the emulator): one batch, up to `most`
    assert [len(b) for b in verification_batches(fours, 0.0)] == [5]
    assert [len(b) for b in verification_batches(fours, 0.0, most=2)] == [2, 2, 1]
    # an admission over the budget on its own still runs, alone
    assert [len(b) for b in verification_batches(fours[:2], 30.0)] == [1, 1]
    with pytest.raises(ValueError, match="most must be at least 1"):
        verification_batches(fours, 0.0, most=0)


def test_admissions_sharing_a_runner_never_share_a_batch() -> None:
    a, b, c = admit(1, (1, 2)), admit(2, (2, 3)), admit(3, (4, 5))
    assert verification_batches([a, b, c], 0.0) == [[a], [b, c]]


@given(
    sizes=st.lists(st.integers(min_value=1, max_value=8), max_size=30),
    interval=st.sampled_from([0.0, 0.25, 1.0, 3.0]),
    most=st.integers(min_value=1, max_value=10),
)
def test_batches_keep_the_plan_order_and_their_bounds(
    sizes: list[int], interval: float, most: int
) -> None:
    admits, first = [], 1
    for job, size in enumerate(sizes):
        admits.append(admit(job + 1, tuple(range(first, first + size))))
        first += size
    batches = verification_batches(admits, interval, most=most)
    assert [a for batch in batches for a in batch] == admits
    for batch in batches:
        assert 1 <= len(batch) <= most
        writes = sum(len(a.runner_ids) + 1 for a in batch)
        assert len(batch) == 1 or writes * interval <= 10.0


# ---- the shared read ------------------------------------------------------------------------


async def test_one_read_after_the_slowest_members_labels_verifies_the_batch() -> None:
    with running_emulator({"a": 4}) as emu:
        first, second = (
            admit(queue(emu, "b1", 2), (1, 2), "b1"),
            admit(queue(emu, "b2", 2), (3, 4), "b2"),
        )
        # the second lease's last label answers a second late: the read must wait for it, or
        # the second would find its label missing (or read again on its own)
        emu.admin.fault("latency", method="POST", path="*/actions/runners/4/labels", ms=1000)
        verifier = BatchVerification([first, second], fleet_size=4, round_wait_s=30.0)
        emu.admin.reset_stats()
        async with client_for(emu) as client:
            outcomes = await asyncio.gather(
                admit_lease(client, first, fleet_size=4, verifier=verifier),
                admit_lease(client, second, fleet_size=4, verifier=verifier),
            )
        assert [o.admitted for o in outcomes] == [True, True], outcomes
        assert verifier.rounds == 1
        assert reads(emu) == {LIST: 1, ONE: 0}  # one page for both, no GET of its own
        placed = lambda: [emu.job_placement(a.job_id) for a in (first, second)]  # noqa: E731
        wait_for(lambda: placed() == [("in_progress", 1), ("in_progress", 3)], what="dispatch")


async def test_a_conflict_found_by_the_shared_read_backs_off_that_admission_alone() -> None:
    with running_emulator({"a": 4}) as emu:
        first, second = (
            admit(queue(emu, "b1", 2), (1, 2), "b1"),
            admit(queue(emu, "b2", 2), (3, 4), "b2"),
        )
        other = LeaseLabel(99, 1, int(time.time()), "othr").render()
        with emu.state.lock:  # another controller leased runner 4 meanwhile
            emu.state.add_labels(emu.state.runners[4], [other])
        verifier = BatchVerification([first, second], fleet_size=4)
        async with client_for(emu) as client:
            ok, backed_off = await asyncio.gather(
                admit_lease(client, first, fleet_size=4, verifier=verifier),
                admit_lease(client, second, fleet_size=4, verifier=verifier),
            )
        assert ok.admitted and not backed_off.admitted
        assert backed_off.reason.startswith("LeaseConflict") and "othr" in backed_off.reason
        assert verifier.rounds == 1
        assert second.lease_label not in emu.runner_labels(3) | emu.runner_labels(4)
        assert other in emu.runner_labels(4)  # never ours to remove


async def test_a_member_that_fails_before_verifying_leaves_and_nobody_waits_for_it() -> None:
    with running_emulator({"a": 4}) as emu:
        first, gone = (
            admit(queue(emu, "b1", 2), (1, 2), "b1"),
            admit(queue(emu, "b2", 2), (3, 4), "b2"),
        )
        with emu.state.lock:  # runner 4 was removed: its label write answers 404
            del emu.state.runners[4]
        verifier = BatchVerification([first, gone], fleet_size=4, round_wait_s=30.0)
        started = time.monotonic()
        async with client_for(emu) as client:

            async def run(a: Admit) -> object:
                try:
                    return await admit_lease(client, a, fleet_size=4, verifier=verifier)
                finally:
                    verifier.leave(a)  # what the tick does for each admission that ended

            ok, failed = await asyncio.gather(run(first), run(gone), return_exceptions=True)
        assert time.monotonic() - started < 10.0  # not the 30 s round wait
        assert isinstance(failed, NotFoundError), failed
        assert getattr(ok, "admitted", False), ok
        assert gone.lease_label not in emu.runner_labels(3)  # its one landed label undone


async def test_a_member_that_never_asks_holds_the_round_no_longer_than_the_wait() -> None:
    with running_emulator({"a": 4}) as emu:
        first, absent = (
            admit(queue(emu, "b1", 2), (1, 2), "b1"),
            admit(queue(emu, "b2", 2), (3, 4), "b2"),
        )
        verifier = BatchVerification([first, absent], fleet_size=4, round_wait_s=0.5)
        started = time.monotonic()
        async with client_for(emu) as client:
            outcome = await admit_lease(client, first, fleet_size=4, verifier=verifier)
        assert outcome.admitted and 0.5 <= time.monotonic() - started < 5.0
        assert verifier.rounds == 1


async def test_a_member_asking_again_after_its_round_reads_on_its_own() -> None:
    with running_emulator({"a": 4}) as emu:
        first, second = (
            admit(queue(emu, "b1", 2), (1, 2), "b1"),
            admit(queue(emu, "b2", 2), (3, 4), "b2"),
        )
        with emu.state.lock:
            for runner, lease in ((1, first), (2, first), (3, second), (4, second)):
                emu.state.add_labels(emu.state.runners[runner], [lease.lease_label])
        verifier = BatchVerification([first, second], fleet_size=4)
        async with client_for(emu) as client:
            await asyncio.gather(verifier.verify(client, first), verifier.verify(client, second))
            emu.admin.reset_stats()
            # a retried step, after the round served it: the labels may have changed since
            with emu.state.lock:
                emu.state.remove_label(emu.state.runners[2], first.lease_label)
            with pytest.raises(Exception, match="no longer carries"):
                await verifier.verify(client, first)
        assert verifier.rounds == 1 and reads(emu)[LIST] == 1


# ---- a busy tick ----------------------------------------------------------------------------


async def test_a_busy_tick_of_four_node_jobs_reads_at_most_two_per_admission() -> None:
    """1,000 runners are 10 pages of the runner list. Verified alone, each 4-node lease read its
    4 runners (24 GETs for 6 admissions); one batch reads the list once (10 pages)."""
    with running_emulator({"a": 1000}) as emu:
        jobs = [queue(emu, f"b{job}", 4) for job in range(1, 7)]
        async with client_for(emu) as client:
            steps = direct_steps(client)
            snapshot = await steps.read_snapshot()  # the tick's own read, measured apart
            emu.admin.reset_stats()
            await steps.read_snapshot()
            snapshot_reads = sum(reads(emu).values())
            emu.admin.reset_stats()
            report = await reconcile_tick(steps, SETTINGS)
        assert report.admitted == 6, report.failures
        assert len(snapshot.runners) == 1000
        verification = sum(reads(emu).values()) - snapshot_reads
        assert reads(emu)[ONE] == 0
        assert verification == 10 and verification / report.admitted <= 2
        assert emu.admin.stats()["writes"] == 6 * (4 + 1)  # N + 1 writes each, no more
        running = lambda: all(emu.job_placement(j)[0] == "in_progress" for j in jobs)  # noqa: E731
        wait_for(running, what="every admitted job dispatched")


def test_the_anchor_window_grows_with_a_longer_orphan_grace_and_never_shrinks() -> None:
    assert anchor_window_s(0) == anchor_window_s(30) == ANCHOR_WITHIN_S == 20
    assert anchor_window_s(90) == pytest.approx(60)


async def test_at_githubs_write_pace_a_longer_orphan_grace_buys_fewer_reads() -> None:
    """At one write a second, 4-node admissions (5 writes each) fit two to a 10 s batch budget:
    8 GETs for 2 admissions. With a 90 s orphan grace the anchor may come 60 s after the stamp,
    the budget is 30 s, and one read of the list's 10 pages verifies all six."""
    counted: dict[float, dict[str, int]] = {}
    for grace in (30.0, 90.0):
        settings = SETTINGS.model_copy(update={"orphan_grace_s": grace})
        with running_emulator({"a": 1000}) as emu:
            for job in range(1, 7):
                queue(emu, f"g{job}", 4)
            async with client_for(emu) as client:
                # the writes are not paced here (the emulator has no secondary limit); the tick
                # sizes its batches for the pace the steps declare
                steps = replace(direct_steps(client), write_interval_s=1.0)
                await steps.read_snapshot()
                emu.admin.reset_stats()
                report = await reconcile_tick(steps, settings)
            assert report.admitted == 6, report.failures
            counted[grace] = reads(emu)
    # the tick's own snapshot is 10 list pages (answered 304) in both
    assert counted[30.0] == {LIST: 10, ONE: 6 * 4}
    assert counted[90.0] == {LIST: 10 + 10, ONE: 0}
