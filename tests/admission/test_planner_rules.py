"""Every planner rule, one scenario each, including the seed's must-pass examples."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

import pytest
from admission_kit import (
    NOW,
    ON,
    admitted,
    apply,
    blocked,
    complete,
    job,
    lease_runners,
    legacy,
    pool,
    snapshot,
)

from slurmgate.admission.capacity import LEGACY
from slurmgate.admission.leases import DispatchCheck, RemovalOutcome, release_lease
from slurmgate.admission.model import BlockReason, JobStatus, ReleaseReason, Runner, Snapshot
from slurmgate.admission.planner import plan
from slurmgate.admission.policies import policy_named, priority_order
from slurmgate.settings.admission import AdmissionSettings

# ---- the seed's examples ------------------------------------------------------------------


def test_running_ten_blocks_nine_and_eight_backfills_the_exact_remainder() -> None:
    ten = job(10, 10, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(pool("x", 18), ten, list(range(1, 11)))
    snap = snapshot(runners, [ten, job(9, 9, age_s=60), job(8, 8, age_s=30)])

    d = plan(snap, ON, NOW)

    assert admitted(d) == {8: 8}
    assert d.admit[0].runner_ids == tuple(range(11, 19))
    assert blocked(d) == {9: BlockReason.NO_CAPACITY}
    row = d.board[0]
    assert (row.pool, row.online, row.admitted_nodes, row.free) == ("cluster:x", 18, 18, 0)

    # the 8 dispatches and runs; the 10 completes, its lease goes, and the 9 fits next tick
    after = apply(snap, d)
    after = replace(
        after,
        jobs=tuple(
            replace(j, status=JobStatus.IN_PROGRESS) if j.id == 8 else j for j in after.jobs
        ),
    )
    after = complete(after, 10)
    d2 = plan(after, ON, NOW + timedelta(seconds=30))
    assert [(r.job_id, r.reason) for r in d2.release] == [(10, ReleaseReason.JOB_FINISHED)]
    assert d2.admit == ()  # the 10's runners still carry its lease until the release is done
    d3 = plan(apply(after, d2), ON, NOW + timedelta(seconds=60))
    assert admitted(d3) == {9: 9}
    assert set(d3.admit[0].runner_ids) <= set(range(1, 11))


def test_equal_scores_queued_together_admit_eight_and_nine_and_block_ten() -> None:
    snap = snapshot(pool("x", 18), [job(10, 10, age_s=90), job(9, 9, age_s=60), job(8, 8)])
    d = plan(snap, ON, NOW)
    assert admitted(d) == {8: 8, 9: 9}
    assert blocked(d) == {10: BlockReason.NO_CAPACITY}
    assert "needs 10" in d.blocked[0].detail and "1 free of 18 online" in d.blocked[0].detail


def test_higher_score_goes_first_even_when_larger() -> None:
    snap = snapshot(pool("x", 18), [job(10, 10, score="2.000"), job(9, 9), job(8, 8)])
    assert admitted(plan(snap, ON, NOW)) == {10: 10, 8: 8}


def test_running_lease_is_kept_and_its_runners_are_not_free_even_if_not_busy() -> None:
    running = job(1, 3, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(pool("x", 4), running, [1, 2, 3])  # busy=False on all of them
    snap = snapshot(runners, [running, job(2, 2)])
    d = plan(snap, ON, NOW + timedelta(hours=5))
    assert d.release == ()
    assert admitted(d) == {}
    assert blocked(d) == {2: BlockReason.NO_CAPACITY}


def test_queued_job_with_a_lease_is_not_admitted_again() -> None:
    queued = job(1, 2)
    snap = snapshot(lease_runners(pool("x", 4), queued, [1, 2]), [queued])
    d = plan(snap, ON, NOW)
    assert d.admit == () and d.release == () and d.blocked == ()


# ---- pools, legacy, misconfigured ---------------------------------------------------------


def test_legacy_runner_serves_one_node_job() -> None:
    snap = snapshot(legacy(2, 1), [job(1, 1, pool_name=None)])
    d = plan(snap, ON, NOW)
    assert admitted(d) == {1: 1}
    assert d.admit[0].pool is None and d.admit[0].runner_ids == (1,)
    assert [row.pool for row in d.board] == [LEGACY]


def test_legacy_runners_never_serve_multi_node_jobs() -> None:
    snap = snapshot(legacy(4, 1), [job(1, 2, pool_name=None)])
    d = plan(snap, ON, NOW)
    assert admitted(d) == {}
    assert blocked(d) == {1: BlockReason.NEVER_FITS}


def test_one_node_job_prefers_a_legacy_runner_over_a_pool_token() -> None:
    snap = snapshot([*pool("x", 2), *legacy(1, 10)], [job(1, 1, pool_name=None)])
    d = plan(snap, ON, NOW)
    assert d.admit[0].runner_ids == (10,) and d.admit[0].pool is None
    # with the legacy runner taken, the next 1-node job falls back to the pool
    d = plan(
        snapshot(
            [*pool("x", 2), *legacy(1, 10)], [job(1, 1, pool_name=None), job(2, 1, pool_name=None)]
        ),
        ON,
        NOW,
    )
    assert {a.job_id: a.pool for a in d.admit} == {1: None, 2: "cluster:x"}


def test_misconfigured_runner_is_reported_and_never_leased() -> None:
    bad = Runner(1, "two-pools", True, False, ("self-hosted", "cluster:x", "cluster:y"))
    snap = snapshot([bad, *pool("x", 1, start=2)], [job(1, 1), job(2, 1, score="0.500")])
    d = plan(snap, ON, NOW)
    assert [rid for rid, _ in d.misconfigured_runners] == [1]
    assert "cluster:x" in d.misconfigured_runners[0][1]
    assert "keep exactly one" in d.misconfigured_runners[0][1]
    assert admitted(d) == {1: 1}
    assert d.admit[0].runner_ids == (2,)
    assert all(1 not in a.runner_ids for a in d.admit)


def test_offline_runners_are_not_capacity() -> None:
    snap = snapshot(pool("x", 4, offline={1, 2}), [job(1, 3), job(2, 2, score="0.500")])
    d = plan(snap, ON, NOW)
    assert blocked(d) == {1: BlockReason.NO_CAPACITY}
    assert admitted(d) == {2: 2}
    assert d.admit[0].runner_ids == (3, 4)


def test_leased_runner_gone_offline_still_counts_as_in_use() -> None:
    running = job(1, 2, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(pool("x", 4, offline={1}), running, [1, 2])
    d = plan(snapshot(runners, [running, job(2, 2)]), ON, NOW)
    # 3 online, 2 in use: a 2-node job would push in-use to 4 > 3 although 2 runners are free
    assert blocked(d) == {2: BlockReason.NO_CAPACITY}
    assert d.board[0].admitted_nodes == 2


def test_never_fitting_job_does_not_block_jobs_behind_it() -> None:
    runners = [*pool("gb200-nv", 4), *pool("h200", 8, start=10)]
    jobs = [job(1, 18, pool_name="gb200-nv", score="5.000"), job(2, 2, pool_name="gb200-nv")]
    d = plan(snapshot(runners, jobs), ON, NOW)
    assert blocked(d) == {1: BlockReason.NEVER_FITS}
    assert d.blocked[0].pool == "cluster:gb200-nv"
    assert "cluster:gb200-nv has 4 runners" in d.blocked[0].detail
    assert admitted(d) == {2: 2}


def test_job_without_compatible_runner_is_no_pool() -> None:
    d = plan(snapshot(pool("x", 4), [job(1, 1, pool_name="nowhere")]), ON, NOW)
    assert blocked(d) == {1: BlockReason.NO_POOL}


def test_tokens_come_from_one_pool_and_best_fit_picks_the_tightest() -> None:
    runners = [*pool("a", 6, extra=("gpu",)), *pool("b", 3, start=10, extra=("gpu",))]
    jobs = [job(1, 3, pool_name=None, extra=("gpu",))]
    d = plan(snapshot(runners, jobs), ON, NOW)
    assert d.admit[0].pool == "cluster:b" and d.admit[0].runner_ids == (10, 11, 12)
    # four nodes fit only in a: never split across the pools
    d = plan(snapshot(runners, [job(2, 4, pool_name=None, extra=("gpu",))]), ON, NOW)
    assert d.admit[0].pool == "cluster:a" and d.admit[0].runner_ids == (1, 2, 3, 4)
    d = plan(snapshot(runners, [job(3, 7, pool_name=None, extra=("gpu",))]), ON, NOW)
    assert blocked(d) == {3: BlockReason.NEVER_FITS}
    assert "cluster:a has 6 runners" in d.blocked[0].detail


def test_labels_match_case_insensitively_and_need_every_unmanaged_label() -> None:
    runners = [*pool("x", 2, extra=("H100",)), *pool("x", 2, start=3)]
    d = plan(snapshot(runners, [job(1, 2, extra=("h100",))]), ON, NOW)
    assert d.admit[0].runner_ids == (1, 2)
    d = plan(snapshot(runners, [job(1, 3, extra=("h100",))]), ON, NOW)
    assert blocked(d) == {1: BlockReason.NEVER_FITS}


def test_busy_runner_and_stray_labelled_runner_are_not_free() -> None:
    runners = pool("x", 3, busy={1})
    runners[1] = replace(runners[1], labels=(*runners[1].labels, "nodes:4"))
    d = plan(snapshot(runners, [job(1, 2)]), ON, NOW)
    assert blocked(d) == {1: BlockReason.NO_CAPACITY}
    assert [(c.runner_id, c.labels) for c in d.clean] == [(2, ("nodes:4",))]


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nodes:", "nodes:0", "nodes:-2", "nodes:1.5", "nodes:x"])
def test_malformed_nodes_label_is_bad_input_and_jobs_behind_still_go(bad: str) -> None:
    broken = replace(job(1, None, score="9.000"), labels=(*job(1, None).labels, bad))
    d = plan(snapshot(pool("x", 4), [broken, job(2, 2)]), ON, NOW)
    assert blocked(d) == {1: BlockReason.BAD_INPUT}
    assert bad in d.blocked[0].detail
    assert admitted(d) == {2: 2}


def test_duplicated_nodes_label_is_bad_input() -> None:
    dup = job(1, 2, extra=("nodes:3",))
    d = plan(snapshot(pool("x", 4), [dup, job(2, 1)]), ON, NOW)
    assert blocked(d) == {1: BlockReason.BAD_INPUT}
    assert "keep exactly one nodes:N" in d.blocked[0].detail
    assert admitted(d) == {2: 1}


def test_two_ci_job_labels_are_bad_input() -> None:
    twice = job(1, 1, extra=("ci-job-2.000-other",))
    d = plan(snapshot(pool("x", 2), [twice]), ON, NOW)
    assert blocked(d) == {1: BlockReason.BAD_INPUT}


@pytest.mark.parametrize(
    "label", ["ci-job-1.000-straße", "ci-attempt-١", "nodes:٢", "CI-SKIP-QUEUE-PR-７"]
)
def test_a_non_ascii_managed_label_is_bad_input_not_folded_onto_the_anchor(label: str) -> None:
    """Case-folding rewrote it (straße -> strasse): the anchor got a label the job never asked
    for, and the lease held its runners while GitHub dispatched nothing."""
    odd = replace(job(1, 2), labels=(*job(1, 2).labels, label))
    d = plan(snapshot(pool("x", 4), [odd, job(2, 2)]), ON, NOW)
    assert blocked(d) == {1: BlockReason.BAD_INPUT}
    assert "non-ASCII" in d.blocked[0].detail and "runs-on" in d.blocked[0].detail
    assert admitted(d) == {2: 2}
    assert all(label.isascii() for a in d.admit for label in a.anchor_labels)


def test_unmanaged_job_is_left_to_github() -> None:
    d = plan(snapshot(pool("x", 2), [job(1, managed=False)]), ON, NOW)
    assert d.admit == () and d.blocked == ()
    assert any("left to GitHub" in note for note in d.notes)


# ---- order and the admit record -----------------------------------------------------------


def test_order_is_score_then_nodes_then_age_then_id() -> None:
    jobs = [
        job(5, 2, score="1.000", age_s=10),
        job(4, 2, score="1.000", age_s=10),
        job(3, 2, score="1.000", age_s=20),
        job(2, 1, score="1.000"),
        job(1, 8, score="1.250"),
    ]
    snap = snapshot(pool("x", 20), jobs)
    d = plan(snap, ON, NOW)
    assert [a.job_id for a in d.admit] == [1, 2, 3, 4, 5]


def test_admit_carries_lease_label_anchor_labels_and_priority() -> None:
    d = plan(snapshot(pool("x", 4), [job(7, 3, score="2.250", attempt=2)]), ON, NOW)
    (a,) = d.admit
    assert a.lease_label == f"ci-lease-j7-a2-t{int(NOW.timestamp())}"
    assert a.anchor_id == 1 and a.runner_ids == (1, 2, 3)
    assert a.anchor_labels == ("ci-attempt-2", "ci-job-2.250-t7", "nodes:3")
    assert a.priority == "2.250" and a.nodes == 3 and a.attempt == 2
    assert "2.250" in a.reason


def test_default_priority_applies_to_jobs_without_a_ci_job_label() -> None:
    nolabel = replace(job(1, 2), labels=("self-hosted", "cluster:x", "nodes:2"))
    settings = ON.model_copy(update={"default_priority": ON.default_priority + 1})
    d = plan(snapshot(pool("x", 2), [job(2, 2), nolabel]), settings, NOW)
    assert admitted(d) == {1: 2}
    assert d.admit[0].priority == "2.000"


# ---- flags --------------------------------------------------------------------------------


def test_priority_scheduler_off_is_inert_but_drains_finished_leases() -> None:
    done = job(1, 2, status=JobStatus.COMPLETED)
    runners = lease_runners(pool("x", 4), done, [1, 2])
    runners[3] = replace(runners[3], labels=(*runners[3].labels, "nodes:1"))  # legacy static label
    off = AdmissionSettings()
    d = plan(snapshot(runners, [done, job(2, 1)]), off, NOW + timedelta(hours=3))
    assert d.admit == () and d.clean == () and d.blocked == ()
    assert [(r.job_id, r.reason) for r in d.release] == [(1, ReleaseReason.JOB_FINISHED)]
    assert any("PRIORITY_SCHEDULER_ENABLED" in note for note in d.notes)


def test_node_slot_off_sizes_every_job_as_one_but_keeps_the_gate_label() -> None:
    priority_only = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True)
    d = plan(snapshot(pool("x", 2), [job(1, 9), job(2, "x")]), priority_only, NOW)
    assert admitted(d) == {1: 1, 2: 1}
    assert "nodes:9" in d.admit[0].anchor_labels


def test_node_slot_off_does_not_call_one_runner_leases_incomplete() -> None:
    priority_only = AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True)
    queued = job(1, 4)
    runners = lease_runners(pool("x", 3), queued, [1])
    d = plan(snapshot(runners, [queued, job(2, 1), job(3, 1)]), priority_only, NOW)
    assert d.release == ()
    assert admitted(d) == {2: 1, 3: 1}


# ---- releases -----------------------------------------------------------------------------


def _release_for(snap: Snapshot, at_s: float = 0) -> list[tuple[int, str]]:
    d = plan(snap, ON, NOW + timedelta(seconds=at_s))
    return [(r.job_id, str(r.reason)) for r in d.release]


def test_release_when_job_finished_removes_lease_everywhere_and_gate_labels_on_anchor() -> None:
    done = job(1, 3, status=JobStatus.COMPLETED)
    runners = lease_runners(pool("x", 4), done, [2, 3, 4])
    d = plan(snapshot(runners, [done]), ON, NOW)
    (r,) = d.release
    assert r.reason == ReleaseReason.JOB_FINISHED
    lease = f"ci-lease-j1-a1-t{int(NOW.timestamp())}"
    assert dict(r.labels) == {
        2: tuple(sorted((lease, "ci-attempt-1", "ci-job-1.000-t1", "nodes:3"))),
        3: (lease,),
        4: (lease,),
    }
    assert d.clean == ()  # the non-anchor holders carry nothing else


def test_release_when_job_missing() -> None:
    gone = job(1, 2)
    runners = lease_runners(pool("x", 2), gone, [1, 2])
    assert _release_for(snapshot(runners, [], missing=frozenset({1}))) == [(1, "job-missing")]


def test_lease_of_unknown_job_is_kept_with_a_note() -> None:
    unknown = job(1, 2)
    runners = lease_runners(pool("x", 2), unknown, [1, 2])
    d = plan(snapshot(runners, []), ON, NOW + timedelta(hours=9))
    assert d.release == ()
    assert any("not in the snapshot" in note for note in d.notes)


def test_anchorless_lease_is_released_only_after_the_grace() -> None:
    queued = job(1, 2)
    runners = lease_runners(pool("x", 2), queued, [1, 2])
    runners = [
        replace(
            r,
            labels=tuple(
                x for x in r.labels if x.startswith(("self", "Linux", "cluster", "ci-lease"))
            ),
        )
        for r in runners
    ]
    snap = snapshot(runners, [queued])
    assert _release_for(snap, at_s=ON.orphan_grace_s - 1) == []
    assert _release_for(snap, at_s=ON.orphan_grace_s + 1) == [(1, "no-anchor")]


def test_runner_judged_releases_wait_while_a_runner_is_unreadable() -> None:
    """GitHub listed a runner we could not read: it may be the anchor the lease seems to lack,
    so the no-anchor release waits for a full read. A finished job's lease is still released."""
    queued, done = job(1, 2), job(2, 1, pool_name="y", status=JobStatus.COMPLETED)
    runners = [
        replace(r, labels=tuple(x for x in r.labels if x.startswith(("self", "cluster", "ci-l"))))
        for r in lease_runners(pool("x", 2), queued, [1, 2])
    ]
    runners += lease_runners(pool("y", 1, start=10), done, [10])
    partial = replace(snapshot(runners, [queued, done]), unreadable_runners=1)
    assert _release_for(partial, at_s=ON.orphan_grace_s + 1) == [(2, "job-finished")]
    full = replace(partial, unreadable_runners=0)
    assert sorted(_release_for(full, at_s=ON.orphan_grace_s + 1)) == [
        (1, "no-anchor"),
        (2, "job-finished"),
    ]


def test_lease_expires_while_its_job_stays_queued_but_not_while_it_runs() -> None:
    queued = job(1, 2)
    runners = lease_runners(pool("x", 2), queued, [1, 2])
    late = ON.queued_lease_limit_s(queued.name) + 1
    assert _release_for(snapshot(runners, [queued]), at_s=late - 2) == []
    assert _release_for(snapshot(runners, [queued]), at_s=late) == [(1, "expired-while-queued")]
    running = replace(queued, status=JobStatus.IN_PROGRESS)
    assert _release_for(snapshot(runners, [running]), at_s=late * 10) == []


def test_incomplete_lease_is_released_while_queued() -> None:
    queued = job(1, 3)
    runners = lease_runners(pool("x", 3), queued, [1, 2])  # anchor says nodes:3, holds 2
    assert _release_for(snapshot(runners, [queued])) == [(1, "incomplete")]
    running = replace(queued, status=JobStatus.IN_PROGRESS)
    assert _release_for(snapshot(runners, [running])) == []


def test_conflicting_leases_keep_the_running_one_then_the_older() -> None:
    a, b = job(1, 2, status=JobStatus.IN_PROGRESS), job(2, 2)
    runners = lease_runners(pool("x", 3), a, [1, 2], created=NOW)
    runners = lease_runners(runners, b, [2, 3], created=NOW - timedelta(seconds=5))
    d = plan(snapshot(runners, [a, b]), ON, NOW)
    assert [(r.job_id, r.reason) for r in d.release] == [(2, ReleaseReason.CONFLICT_LOST)]
    # neither running: the older lease (job 2's) wins
    d = plan(snapshot(runners, [replace(a, status=JobStatus.QUEUED), b]), ON, NOW)
    assert [(r.job_id, r.reason) for r in d.release] == [(1, ReleaseReason.CONFLICT_LOST)]
    lost = dict(d.release[0].labels)
    assert lost[2] == (f"ci-lease-j1-a1-t{int(NOW.timestamp())}",)  # shared runner keeps b's


def test_conflict_prefers_an_anchored_lease_over_an_older_anchorless_one() -> None:
    a, b = job(1, 2), job(2, 2)
    runners = lease_runners(pool("x", 3), a, [1, 2], created=NOW)  # a anchored on runner 1
    older = f"ci-lease-j2-a1-t{int(NOW.timestamp()) - 5}"  # b: older, mid-protocol, no anchor
    runners = [replace(r, labels=(*r.labels, older)) if r.id in (2, 3) else r for r in runners]
    d = plan(snapshot(runners, [a, b]), ON, NOW)
    assert [(r.job_id, r.reason) for r in d.release] == [(2, ReleaseReason.CONFLICT_LOST)]
    assert dict(d.release[0].labels) == {2: (older,), 3: (older,)}


def test_a_lost_lease_on_another_jobs_busy_anchor_is_released_not_kept_as_started() -> None:
    # A crash leaves job 2's lease label on runner 2, the anchor job 1 runs on: job 2's lease
    # loses the conflict. Runner 2 is busy with job 1, which says nothing of job 2; judged as
    # job 2's anchor, it kept job 2's lease "started" for as long as job 1 ran.
    a = replace(job(1, 2, status=JobStatus.IN_PROGRESS), runner_id=2)
    b = job(2, 2)
    runners = lease_runners(pool("x", 4, busy={2}), a, [2, 3])
    stale = f"ci-lease-j2-a1-t{int(NOW.timestamp()) - 200}"
    runners = [replace(r, labels=(*r.labels, stale)) if r.id in (2, 4) else r for r in runners]
    d = plan(snapshot(runners, [a, b]), ON, NOW)
    assert [(r.job_id, r.reason) for r in d.release] == [(2, ReleaseReason.CONFLICT_LOST)]
    release = d.release[0]
    assert dict(release.labels) == {2: (stale,), 4: (stale,)}  # job 1's labels stay
    busy = {r.id: r.busy for r in runners}
    removed: list[tuple[int, str]] = []

    async def read(job_id: int, anchor_id: int | None) -> DispatchCheck:
        # what GitHub answers now: job 2 still queued, the anchor asked about as it is
        return DispatchCheck(b, anchor_id is not None and busy[anchor_id])

    async def remove(pairs: Sequence[tuple[int, Sequence[str]]]) -> RemovalOutcome:
        removed.extend((rid, label) for rid, labels in pairs for label in labels)
        return RemovalOutcome(tuple(removed), ())

    outcome = asyncio.run(release_lease(release, remove, read))
    assert outcome.released, outcome.reason
    assert sorted(removed) == [(2, stale), (4, stale)]
    # no dispatch gate to take first: job 2's labels are on none of its runners
    assert release.may_dispatch and release.anchor_id is None and release.dispatch_gate == ()


# ---- cleans -------------------------------------------------------------------------------


def test_static_nodes_label_on_idle_runner_is_cleaned_but_not_on_a_busy_one() -> None:
    runners = pool("x", 3, busy={2})
    runners = [replace(r, labels=(*r.labels, "Nodes:2", "ci-attempt-3")) for r in runners]
    d = plan(snapshot(runners, []), ON, NOW)
    assert [(c.runner_id, c.labels) for c in d.clean] == [
        (1, ("Nodes:2", "ci-attempt-3")),
        (3, ("Nodes:2", "ci-attempt-3")),
    ]
    assert all("self-hosted" not in c.labels and "cluster:x" not in c.labels for c in d.clean)


def test_malformed_lease_label_is_cleaned() -> None:
    runners = pool("x", 2)
    runners[0] = replace(runners[0], labels=(*runners[0].labels, "ci-lease-bogus"))
    d = plan(snapshot(runners, [job(1, 2)]), ON, NOW)
    assert [(c.runner_id, c.labels) for c in d.clean] == [(1, ("ci-lease-bogus",))]
    assert blocked(d) == {1: BlockReason.NO_CAPACITY}  # not free until the clean is done


# ---- determinism and policy seam ----------------------------------------------------------


def test_same_input_in_any_order_gives_the_same_decisions() -> None:
    running = job(1, 5, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(
        [*pool("a", 12), *pool("b", 6, start=20), *legacy(3, 40)], running, [1, 2, 3, 4, 5]
    )
    jobs = [running] + [
        job(i, (i % 7) + 1, pool_name=None, score=f"{i % 3}.000", age_s=i) for i in range(2, 30)
    ]
    first = plan(snapshot(runners, jobs), ON, NOW)
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(runners)
        rng.shuffle(jobs)
        assert plan(snapshot(runners, jobs), ON, NOW) == first


def test_policy_is_chosen_by_name() -> None:
    assert policy_named("greedy").name == "greedy"
    with pytest.raises(ValueError, match="SLURMGATE_POLICY"):
        policy_named("fcfs")
    assert priority_order([]) == []


def test_board_counts_per_pool_and_legacy_row() -> None:
    running = job(1, 2, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(pool("x", 5, busy={5}, offline={4}), running, [1, 2])
    runners += legacy(2, 10)
    d = plan(snapshot(runners, [running, job(2, 1, pool_name=None), job(3, 9)]), ON, NOW)
    rows = {row.pool: row for row in d.board}
    assert list(rows) == [LEGACY, "cluster:x"]
    x = rows["cluster:x"]
    assert (x.runners, x.online, x.leased, x.busy_unleased) == (5, 4, 2, 1)
    assert (x.free, x.admitted_nodes, x.blocked) == (1, 2, 1)  # runner 3 free; the 9 blocked
    legacy_row = rows[LEGACY]
    assert (legacy_row.runners, legacy_row.free, legacy_row.admitted_nodes) == (2, 1, 1)
