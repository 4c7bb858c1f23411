"""Lease labels carry a per-admission nonce: two controllers admitting one job in the same
second write two leases, and the planner's conflict rule keeps exactly one of them."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from admission_kit import NOW, ON, job, pool, snapshot

from slurmgate.admission.labels import LabelError, LeaseLabel
from slurmgate.admission.leases import admit_lease, lease_labels_for_job
from slurmgate.admission.model import Admit, JobStatus, Runner, leases_from_fleet
from slurmgate.admission.planner import plan
from slurmgate.admission.tick import reconcile_tick, restamped
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

GATE = ("ci-attempt-1", "ci-job-1.000-twin", "nodes:2")


def test_the_label_renders_and_parses_its_nonce_and_still_reads_the_old_form() -> None:
    label = LeaseLabel(42, 2, 1_800_000_000, "k3x9q0")
    assert label.render() == "ci-lease-j42-a2-t1800000000-k3x9q0"
    assert LeaseLabel.parse(label.render()) == label
    assert LeaseLabel.parse("CI-LEASE-J42-A2-T1800000000-K3X9Q0") == label  # GitHub folds case
    assert label.lease_id == "j42-a2-t1800000000-k3x9q0"
    old = LeaseLabel.parse("ci-lease-j42-a2-t1800000000")  # written by an older version
    assert old == LeaseLabel(42, 2, 1_800_000_000) and old.nonce == ""
    assert old.render() == "ci-lease-j42-a2-t1800000000"
    for bad in ("ci-lease-j42-a2-t1800000000-", "ci-lease-j42-a2-t1800000000-no_pe"):
        with pytest.raises(LabelError):
            LeaseLabel.parse(bad)
    with pytest.raises(LabelError, match="base36"):
        LeaseLabel(42, 2, 1_800_000_000, "Not-Base36")


def test_release_lease_finds_a_jobs_leases_in_both_forms() -> None:
    """The release-lease flow (a CI job's `if: always()` step) frees leases written before and
    after the upgrade alike, and only that job's."""
    old, new = "ci-lease-j5-a1-t1800000000", "ci-lease-j5-a1-t1800000001-0abc9z"
    other = "ci-lease-j6-a1-t1800000000-zz0000"
    fleet = [
        Runner(1, "r1", True, True, ("cluster:a", old, *GATE)),
        Runner(2, "r2", True, False, ("cluster:a", old)),
        Runner(3, "r3", True, False, ("cluster:a", new)),
        Runner(4, "r4", True, False, ("cluster:a", other)),
    ]
    assert lease_labels_for_job(fleet, 5, 1) == [
        (1, (*sorted(GATE), old)),
        (2, (old,)),
        (3, (new,)),
    ]


def test_two_admissions_of_one_job_in_the_same_second_get_two_labels() -> None:
    planned = _admit(7, (1, 2))
    at = datetime.fromtimestamp(1_800_000_000, UTC)
    first, second = restamped(planned, at), restamped(planned, at)
    a, b = LeaseLabel.parse(first.lease_label), LeaseLabel.parse(second.lease_label)
    assert (a.job_id, a.attempt, a.created_at) == (b.job_id, b.attempt, b.created_at)
    assert len(a.nonce) == 6 and first.lease_label != second.lease_label
    assert restamped(first, at).lease_label == first.lease_label  # a retry keeps its label


def test_the_conflict_rule_keeps_one_of_two_leases_of_the_same_job() -> None:
    """Two anchored leases of one queued job on disjoint runners, stamped the same second: one
    is released, the same one whichever order the fleet is listed in."""
    queued = job(1, 2)
    runners = pool("x", 4)
    stamp = int(NOW.timestamp())
    for ids, nonce in (((1, 2), "aaaaaa"), ((3, 4), "bbbbbb")):
        label = LeaseLabel(1, 1, stamp, nonce).render()
        runners = [
            replace(r, labels=(*r.labels, label, *(queued.gate_labels() if r.id == ids[0] else ())))
            if r.id in ids
            else r
            for r in runners
        ]
    assert len(leases_from_fleet(runners)[0]) == 2
    for order in (runners, list(reversed(runners))):
        decisions = plan(snapshot(order, [queued]), ON, NOW)
        assert [(r.lease_label, r.reason.value) for r in decisions.release] == [
            (LeaseLabel(1, 1, stamp, "bbbbbb").render(), "conflict-lost")
        ]
        assert "of the same job 1" in decisions.release[0].detail


def test_a_running_job_keeps_its_whole_lease_over_an_older_short_twin() -> None:
    """A killed admission's twin landed on the anchor only; the job runs on that anchor under
    both labels. Keeping the older twin would leave the 2-node job holding one token."""
    running = replace(job(1, 2), status=JobStatus.IN_PROGRESS, runner_id=1)
    stamp = int(NOW.timestamp())
    short = LeaseLabel(1, 1, stamp - 1, "aaaaaa").render()  # older, on runner 1 alone
    whole = LeaseLabel(1, 1, stamp, "bbbbbb").render()  # on runners 1 and 2
    runners = pool("x", 3)
    runners[0] = replace(
        runners[0], busy=True, labels=(*runners[0].labels, short, whole, *running.gate_labels())
    )
    runners[1] = replace(runners[1], labels=(*runners[1].labels, whole))
    decisions = plan(snapshot(runners, [running]), ON, NOW)
    assert [(r.lease_label, r.reason.value) for r in decisions.release] == [
        (short, "conflict-lost")
    ]


async def test_two_controllers_admitting_one_job_in_the_same_second_leave_one_lease() -> None:
    """Controllers A and B read the fleet a moment apart and choose different runners for the
    same job in the same second. Both leases verify (they share no runner); with one label
    they read as one 4-runner lease of a 2-node job. The next tick keeps exactly one."""
    with running_emulator({"a": 4}) as emu:
        job_id = emu.admin.add_job(["self-hosted", "cluster:a", *GATE], duration_s=600)["id"]
        at = datetime.fromtimestamp(int(time.time()), UTC)
        by_a = restamped(_admit(job_id, (1, 2)), at)
        by_b = restamped(_admit(job_id, (3, 4)), at)
        assert by_a.lease_label != by_b.lease_label
        async with _client(emu) as a, _client(emu) as b:
            assert (await admit_lease(a, by_a, fleet_size=4)).admitted
            # B verifies by reading its own two runners (a fleet of many list pages), so it
            # cannot see A's anchor; on a whole-fleet read it would back off instead
            # (test_lease_races.py).
            assert (await admit_lease(b, by_b, fleet_size=1000)).admitted
            leases = leases_from_fleet(_fleet(emu))[0]
            assert sorted(lease.size for lease in leases) == [2, 2]
            report = await reconcile_tick(direct_steps(a), ON)
        assert report.released == 1 and report.admitted == 0, report.failures
        [kept] = leases_from_fleet(_fleet(emu))[0]
        with emu.state.lock:
            runs_on = emu.state.jobs[job_id].runner_id
        assert kept.label == by_a.lease_label and runs_on in kept.runner_ids
        assert kept.size == 2


def _admit(job_id: int, runner_ids: tuple[int, ...]) -> Admit:
    return Admit(
        job_id=job_id,
        attempt=1,
        pool="cluster:a",
        nodes=2,
        runner_ids=runner_ids,
        anchor_id=runner_ids[0],
        lease_label=LeaseLabel(job_id, 1, 1).render(),  # restamped when admitted
        anchor_labels=GATE,
        priority="1.000",
        reason="test",
    )


def _client(emu: RunningEmulator) -> GitHubClient:
    scope = GitHubScope(api_url=emu.url, repo=emu.repo)
    return GitHubClient(scope, emu.token, min_write_interval_s=0)


def _fleet(emu: RunningEmulator) -> list[Runner]:
    with emu.state.lock:
        return [
            Runner(r.id, r.name, r.status == "online", r.busy, tuple(n for n, _ in r.labels))
            for r in emu.state.runners.values()
        ]
