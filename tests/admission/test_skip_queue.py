"""Planner rules for skip-queue jobs: a verified one outranks every score, an unverified one not."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from admission_kit import NOW, ON, admitted, blocked, job, lease_runners, pool, snapshot

from slurmgate.admission.model import Job, JobStatus, Snapshot
from slurmgate.admission.planner import plan


def skip_job(job_id: int, nodes: int = 3, score: str = "2.250", pr: int = 77) -> Job:
    return job(job_id, nodes, score=score, extra=(f"ci-skip-queue-pr-{pr}",))


def long_queue_with_one_skip_job() -> tuple[Snapshot, int]:
    """10 jobs of score 5.000, older than a skip-queue job of 2.250; room for one 3-node job."""
    queue = [job(100 + n, 3, score="5.000", age_s=600 - n) for n in range(10)]
    return snapshot(pool("x", 3), [*queue, skip_job(200)]), 200


def test_a_verified_skip_queue_job_jumps_a_long_queue_of_higher_scores() -> None:
    snap, skipper = long_queue_with_one_skip_job()
    d = plan(replace(snap, skip_queue_job_ids=frozenset({skipper})), ON, NOW)
    assert admitted(d) == {skipper: 3}
    assert set(blocked(d)) == {100 + n for n in range(10)}
    (admit,) = d.admit
    assert admit.priority == "skip-queue"
    assert "priority skip-queue" in admit.line()
    # its anchor gets the skip-queue label too, or GitHub could never dispatch the job there
    assert "ci-skip-queue-pr-77" in admit.anchor_labels


def test_an_unverified_skip_queue_label_keeps_its_numeric_place() -> None:
    snap, skipper = long_queue_with_one_skip_job()
    d = plan(snap, ON, NOW)  # the read verified nobody
    assert admitted(d) == {100: 3}  # the oldest of the 5.000 jobs
    assert skipper in blocked(d)
    # a verified job that is not this one changes nothing for it either
    d = plan(replace(snap, skip_queue_job_ids=frozenset({999})), ON, NOW)
    assert admitted(d) == {100: 3}
    # its place is its score's: unverified, it is neither demoted nor promoted
    top = snapshot(pool("x", 3), [*snap.jobs[:-1], skip_job(200, score="6.000")])
    assert admitted(plan(top, ON, NOW)) == {200: 3}


def test_among_skip_queue_jobs_score_then_fewer_nodes_then_age_decide() -> None:
    jobs = [
        job(1, 1, score="9.000"),
        skip_job(2, nodes=2, score="1.000"),
        skip_job(3, nodes=2, score="2.250"),
        skip_job(4, nodes=1, score="2.250"),
        replace(skip_job(5, nodes=1, score="2.250"), created_at=NOW - timedelta(seconds=60)),
    ]
    verified = frozenset({2, 3, 4, 5})
    for capacity, expected in [(1, {5}), (2, {5, 4}), (4, {5, 4, 3}), (6, {5, 4, 3, 2})]:
        snap = replace(snapshot(pool("x", capacity), jobs), skip_queue_job_ids=verified)
        decisions = plan(replace(snap), ON.model_copy(update={"policy": "greedy"}), NOW)
        assert set(admitted(decisions)) == expected, capacity
    snap = replace(snapshot(pool("x", 7), jobs), skip_queue_job_ids=verified)
    assert set(admitted(plan(snap, ON, NOW))) == {1, 2, 3, 4, 5}


def test_a_blocked_skip_queue_job_is_not_delayed_by_backfill() -> None:
    """EASY protects a young blocked job only after reserve_after_s (1 h); a skip-queue job is
    protected at once, so a long 1-node job may not take a runner its start needs."""
    running = replace(job(1, 2, status=JobStatus.IN_PROGRESS), started_at=NOW - timedelta(hours=1))
    runners = lease_runners(pool("x", 4), running, [1, 2])
    jobs = [running, skip_job(2, nodes=4), job(3, 1, score="5.000")]
    snap = snapshot(runners, jobs)
    assert ON.policy == "easy" and ON.reserve_after_s == 3600
    assert admitted(plan(snap, ON, NOW)) == {3: 1}  # unverified: the small job backfills
    d = plan(replace(snap, skip_queue_job_ids=frozenset({2})), ON, NOW)
    assert admitted(d) == {}
    assert blocked(d) == {2: "no-free-capacity", 3: "held-for-reservation"}
