"""A cordoned pool admits nothing new, its leases finish, the board says cordoned then drained."""

from __future__ import annotations

import pytest
from admission_kit import NOW, apply, complete, job, lease_runners, pool, snapshot
from pydantic import ValidationError

from slurmgate.admission.model import JobStatus
from slurmgate.admission.planner import plan
from slurmgate.settings.admission import AdmissionSettings


def cordoned(**cordons: str) -> AdmissionSettings:
    return AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        cordoned_pools=cordons,
    )


@pytest.mark.parametrize("policy", ["greedy", "easy", "conservative"])
def test_a_cordoned_pool_admits_nothing_and_its_leases_run_to_the_end(policy: str) -> None:
    running = job(1, 2, status=JobStatus.IN_PROGRESS)
    queued_lease = job(2, 2)  # admitted before the cordon; GitHub has not dispatched it yet
    runners = lease_runners(lease_runners(pool("x", 8), running, [1, 2]), queued_lease, [3, 4])
    waiting = job(3, 2, age_s=30_000)  # old enough for a reservation under easy/conservative
    snap = snapshot(runners, [running, queued_lease, waiting])
    settings = cordoned(x="node swap").model_copy(update={"policy": policy})
    decisions = plan(snap, settings, NOW)
    assert decisions.admit == () and decisions.release == ()  # both leases are kept
    [wait] = decisions.blocked
    assert (wait.reason.value, wait.pool) == ("pool-cordoned", "cluster:x")
    assert "cluster:x cordoned (node swap); `slurmgate uncordon` reopens" in wait.detail
    [row] = decisions.board_rows()
    assert row["cordon"] == "cordoned (node swap): draining, 2 lease(s) left"
    assert "job 3 (2n): pool-cordoned" in str(row["blocked"])
    # the leases' jobs end: released as always, and the pool is drained
    done = apply(snap, decisions)
    done = complete(complete(done, 1), 2)
    released = plan(done, settings, NOW)
    assert {r.job_id for r in released.release} == {1, 2} and released.admit == ()
    [row] = plan(apply(done, released), settings, NOW).board_rows()
    assert row["cordon"] == "cordoned (node swap): drained"
    # undone: the same queue is admitted on the next plan
    assert [a.job_id for a in plan(apply(done, released), cordoned(), NOW).admit] == [3]


def test_a_job_of_two_pools_goes_to_the_open_one_and_other_pools_are_untouched() -> None:
    runners = pool("x", 4, extra=("gpu",)) + pool("y", 4, 5, extra=("gpu",))
    jobs = [
        job(1, 2, pool_name=None, extra=("gpu",)),
        job(2, 2, pool_name="x"),
        job(3, 2, pool_name="y"),
    ]
    decisions = plan(snapshot(runners, jobs), cordoned(**{"cluster:X": "maint"}), NOW)
    assert {a.job_id: a.pool for a in decisions.admit} == {1: "cluster:y", 3: "cluster:y"}
    assert [(b.job_id, b.reason.value) for b in decisions.blocked] == [(2, "pool-cordoned")]
    rows = {row["pool"]: row["cordon"] for row in decisions.board_rows()}
    assert rows == {"cluster:x": "cordoned (maint): drained", "cluster:y": ""}


def test_cordons_come_from_the_environment_and_bad_names_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURMGATE_CORDONED_POOLS", '{"H100": "  swap\\n PSUs ", "cluster:b": ""}')
    assert AdmissionSettings().cordoned_pools == {
        "cluster:h100": "swap PSUs",
        "cluster:b": "cordoned",
    }
    with pytest.raises(ValidationError, match="cordoned_pools key 'two words' must be a pool name"):
        AdmissionSettings(cordoned_pools={"two words": "x"})
