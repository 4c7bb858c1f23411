"""Reservation policies through plan(): EASY, conservative, estimates, overruns, invariants."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from admission_kit import (
    NOW,
    admitted,
    apply,
    blocked,
    complete,
    job,
    lease_runners,
    pool,
    snapshot,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_planner_properties import World, check_admissions, worlds

from slurmgate.admission.estimates import RuntimeHistory, job_key
from slurmgate.admission.model import BlockReason, Job, JobStatus
from slurmgate.admission.planner import plan
from slurmgate.admission.policies import policy_for
from slurmgate.admission.settings import AdmissionSettings


def cfg(policy: str, **knobs: Any) -> AdmissionSettings:
    return AdmissionSettings.model_validate(
        {
            "PRIORITY_SCHEDULER_ENABLED": True,
            "NODE_SLOT_SCHEDULER_ENABLED": True,
            "policy": policy,
            "estimates": "timeout",
            "reserve_after_s": 0,
            **knobs,
        }
    )


def named(the_job: Job, name: str) -> Job:
    return replace(the_job, name=name)


def running(job_id: int, nodes: int, started_h_ago: float, name: str = "long") -> Job:
    return replace(
        job(job_id, nodes, status=JobStatus.IN_PROGRESS, age_s=int(started_h_ago * 3600) + 60),
        name=name,
        started_at=NOW - timedelta(hours=started_h_ago),
    )


def test_easy_holds_a_backfill_that_would_delay_the_top_job_and_admits_one_that_ends_first() -> (
    None
):
    r = running(1, 8, started_h_ago=7)  # 480 min timeout: expected to end in 1 h
    runners = lease_runners(pool("x", 16), r, list(range(1, 9)))
    a = named(job(2, 9, score="2.000"), "long")
    b = named(job(3, 8), "long")  # 8 h: would hold 8 of the 7 runners A leaves over
    c = named(job(4, 2, score="0.500"), "quick")  # 30 min: ends before A's reservation
    snap = snapshot(runners, [r, a, b, c])
    knobs = {"timeout_overrides": {"quick": 30}}

    greedy = plan(snap, cfg("greedy", **knobs), NOW)
    assert admitted(greedy) == {3: 8}

    easy = plan(snap, cfg("easy", **knobs), NOW)
    assert admitted(easy) == {4: 2}
    assert blocked(easy) == {2: BlockReason.NO_CAPACITY, 3: BlockReason.RESERVED}
    why = {x.job_id: x.detail for x in easy.blocked}
    assert "reserved cluster:x in 3600s" in why[2]
    assert "would delay a reservation" in why[3]

    # the reservation holds: when the running job completes, A gets its 9 runners at once
    later = apply(snap, easy)
    later = replace(
        later,
        jobs=tuple(
            replace(j, status=JobStatus.IN_PROGRESS, started_at=NOW) if j.id == 4 else j
            for j in later.jobs
        ),
    )
    later = complete(later, 1)
    at = NOW + timedelta(hours=1)
    released = plan(later, cfg("easy", **knobs), at)
    assert [x.job_id for x in released.release] == [1]
    after = plan(apply(later, released), cfg("easy", **knobs), at)
    assert admitted(after) == {2: 9}


def three_jobs() -> tuple[Any, dict[str, Any]]:
    r = running(1, 6, started_h_ago=7)  # ends in 1 h; 4 of 10 free
    runners = lease_runners(pool("x", 10), r, list(range(1, 7)))
    a = named(job(2, 8, score="3.000"), "long")  # reserved [1 h, 9 h), leaves 2 over
    b = named(job(3, 9, score="2.000"), "long")  # next blocked: [9 h, 17 h) if protected
    c = named(job(4, 2, score="1.000"), "c-long")  # 9.5 h on the 2 A leaves over
    return snapshot(runners, [r, a, b, c]), {"timeout_overrides": {"c-long": 570}}


def test_easy_protects_only_the_top_blocked_job() -> None:
    snap, knobs = three_jobs()
    d = plan(snap, cfg("easy", **knobs), NOW)
    assert admitted(d) == {4: 2}  # it delays B (needs 9 at 9 h), which EASY does not protect


def test_conservative_protects_every_blocked_job_up_to_its_depth() -> None:
    snap, knobs = three_jobs()
    d = plan(snap, cfg("conservative", **knobs), NOW)
    assert admitted(d) == {}
    assert blocked(d)[4] == BlockReason.RESERVED
    shallow = plan(snap, cfg("conservative", reservation_depth=1, **knobs), NOW)
    assert admitted(shallow) == {4: 2}  # depth 1 is EASY


def overrun_case(name: str) -> Any:
    r = running(1, 4, started_h_ago=10)  # 8 h timeout passed 2 h ago: still running
    runners = lease_runners(pool("x", 6), r, [1, 2, 3, 4])
    return snapshot(runners, [r, named(job(2, 6, score="2.000"), "long"), named(job(3, 2), name)])


def test_a_job_past_its_timeout_is_expected_to_end_one_extension_from_now() -> None:
    knobs = {"timeout_overrides": {"quick": 5, "slowish": 15}}
    assert admitted(plan(overrun_case("quick"), cfg("easy", **knobs), NOW)) == {3: 2}
    held = plan(overrun_case("slowish"), cfg("easy", **knobs), NOW)
    assert admitted(held) == {} and blocked(held)[3] == BlockReason.RESERVED
    longer = cfg("easy", overrun_extension_s=1200, **knobs)
    assert admitted(plan(overrun_case("slowish"), longer, NOW)) == {3: 2}


def test_learned_estimates_come_from_the_history_of_the_job_key() -> None:
    knobs: dict[str, Any] = {"timeout_overrides": {"slowish": 15}}
    history = RuntimeHistory()
    for i in range(3):
        history.record(job_key("slowish", 2), 100 + i, 200 + i, 1000 + i)
    snap = overrun_case("slowish")
    learned = cfg("easy", estimates="learned", **knobs)
    assert admitted(plan(snap, learned, NOW, history=history)) == {3: 2}
    assert admitted(plan(snap, learned, NOW)) == {}  # no history: the 15 min timeout
    assert admitted(plan(snap, cfg("easy", **knobs), NOW, history=history)) == {}


def test_reserve_after_lets_young_jobs_backfill_greedily() -> None:
    snap, knobs = three_jobs()
    aged = cfg("easy", reserve_after_s=3600, **knobs)
    young = plan(snap, aged, NOW)
    # nobody has waited an hour: no reservation, so the 4 free runners go as greedy would
    assert admitted(young) == admitted(plan(snap, cfg("greedy", **knobs), NOW))
    old = replace(
        snap,
        jobs=tuple(replace(j, created_at=j.created_at - timedelta(hours=2)) for j in snap.jobs),
    )
    assert admitted(plan(old, aged, NOW)) == admitted(plan(old, cfg("easy", **knobs), NOW))


def wide_behind_a_backfill(a_name: str, a_age_h: float) -> Any:
    """A (8 of 10) can start in 1 h; C (4, 9.5 h) fits now but would delay A if A is reserved."""
    r = running(1, 6, started_h_ago=7)
    runners = lease_runners(pool("x", 10), r, list(range(1, 7)))
    a = named(job(2, 8, score="3.000", age_s=int(a_age_h * 3600)), a_name)
    c = named(job(3, 4, score="1.000"), "c-long")
    return snapshot(runners, [r, a, c])


def test_reserve_slowdown_reserves_once_the_wait_reaches_b_times_the_jobs_own_estimate() -> None:
    knobs: dict[str, Any] = {"timeout_overrides": {"c-long": 570, "a-short": 60}}
    by_slowdown = cfg("easy", reserve_slowdown=1.0, **knobs)
    by_age = cfg("easy", reserve_after_s=5 * 3600, **knobs)
    # A is estimated at its 8 h timeout: after 2 h its slowdown is 0.25, C backfills
    assert admitted(plan(wide_behind_a_backfill("a-long", 2), by_slowdown, NOW)) == {3: 4}
    # after 9 h it passed 1: A is reserved and C, which would delay it, waits
    held = plan(wide_behind_a_backfill("a-long", 9), by_slowdown, NOW)
    assert admitted(held) == {} and blocked(held)[3] == BlockReason.RESERVED
    # a 1 h job that waited 2 h is protected, where a fixed 5 h wait is not yet reached
    short = wide_behind_a_backfill("a-short", 2)
    assert admitted(plan(short, by_slowdown, NOW)) == {}
    assert admitted(plan(short, by_age, NOW)) == {3: 4}
    # the bound replaces reserve_after_s when both are set
    both = cfg("easy", reserve_after_s=5 * 3600, reserve_slowdown=1.0, **knobs)
    assert admitted(plan(short, both, NOW)) == {}


def test_reserve_after_runtimes_scales_the_trigger_with_the_running_leases_estimates() -> None:
    # the one running lease is estimated at its 8 h timeout: k = 0.5 of it is a 4 h trigger
    knobs: dict[str, Any] = {"timeout_overrides": {"c-long": 570}}
    by_runtimes = cfg("easy", reserve_after_runtimes=0.5, **knobs)
    assert admitted(plan(wide_behind_a_backfill("a", 3), by_runtimes, NOW)) == {3: 4}
    held = plan(wide_behind_a_backfill("a", 4.5), by_runtimes, NOW)
    assert admitted(held) == {} and blocked(held)[3] == BlockReason.RESERVED
    # it comes before reserve_after_s when shorter (5 h alone would not protect A yet) ...
    both = cfg("easy", reserve_after_s=5 * 3600, reserve_after_runtimes=0.5, **knobs)
    assert admitted(plan(wide_behind_a_backfill("a", 4.5), both, NOW)) == {}
    # ... and the same wait is short where the running work is long: k = 1 is an 8 h trigger
    longer = cfg("easy", reserve_after_runtimes=1.0, **knobs)
    assert admitted(plan(wide_behind_a_backfill("a", 4.5), longer, NOW)) == {3: 4}
    assert admitted(plan(wide_behind_a_backfill("a", 5.5), longer, NOW)) == {3: 4}
    # reserve_after_s caps it: after 5.5 h A is protected although 8 h are not reached
    capped = cfg("easy", reserve_after_s=5 * 3600, reserve_after_runtimes=1.0, **knobs)
    assert admitted(plan(wide_behind_a_backfill("a", 5.5), capped, NOW)) == {}
    # reserve_slowdown, when also set, decides (A's own 8 h estimate: 4.5 h is a slowdown < 1)
    slowdown = cfg("easy", reserve_after_runtimes=0.5, reserve_slowdown=1.0, **knobs)
    assert admitted(plan(wide_behind_a_backfill("a", 4.5), slowdown, NOW)) == {3: 4}


def test_reserve_wide_frac_reserves_a_wide_job_at_once_and_leaves_narrow_ones_to_the_trigger() -> (
    None
):
    knobs: dict[str, Any] = {"timeout_overrides": {"c-long": 570}, "reserve_after_s": 5 * 3600}
    fresh = wide_behind_a_backfill("a", 0)  # A needs 8 of 10 and has not waited
    assert admitted(plan(fresh, cfg("easy", **knobs), NOW)) == {3: 4}
    wide = cfg("easy", reserve_wide_frac=0.5, **knobs)
    held = plan(fresh, wide, NOW)
    assert admitted(held) == {} and blocked(held)[3] == BlockReason.RESERVED
    # 8 is not more than 0.9 of the pool: A waits for the 5 h trigger like any job
    assert admitted(plan(fresh, cfg("easy", reserve_wide_frac=0.9, **knobs), NOW)) == {3: 4}
    assert AdmissionSettings().reserve_wide_frac is None


def test_backfill_bound_timeout_checks_a_backfill_against_a_reservation_for_its_timeout() -> None:
    # C's key ran 30 min three times, but its timeout is 9.5 h: learned, it ends before A's
    # reservation in 1 h; if that prediction is wrong, C holds 4 of the 2 runners A leaves over
    knobs: dict[str, Any] = {
        "estimates": "learned",
        "timeout_overrides": {"c-long": 570, "quick": 30},
    }
    history = RuntimeHistory()
    for i in range(3):
        history.record(job_key("c-long", 4), 100 + i, 1800, 1000 + i)
    snap = wide_behind_a_backfill("a", 0)
    predicted = plan(snap, cfg("easy", **knobs), NOW, history=history)
    assert admitted(predicted) == {3: 4}
    bounded = cfg("easy", backfill_bound="timeout", **knobs)
    held = plan(snap, bounded, NOW, history=history)
    assert admitted(held) == {} and blocked(held)[3] == BlockReason.RESERVED
    # a job whose timeout ends before the reservation still backfills
    quick = replace(snap, jobs=(*snap.jobs[:2], named(job(3, 4, score="1.000"), "quick")))
    assert admitted(plan(quick, bounded, NOW, history=history)) == {3: 4}
    # with no reservation yet (A not due), the bound changes nothing: C starts on its estimate
    young = cfg("easy", backfill_bound="timeout", reserve_after_s=5 * 3600, **knobs)
    assert admitted(plan(snap, young, NOW, history=history)) == {3: 4}
    assert AdmissionSettings().backfill_bound == "predicted"


def three_running_and_a_wide_job(a_age_h: float) -> Any:
    """Leases of 1 h, 2 h and 8 h estimates (2 nodes each) on 10 runners; A (8) waits; C (4,
    9.5 h) fits now but would delay A's reservation."""
    leases = [(1, "brief"), (2, "medium"), (3, "long")]
    runners = pool("x", 10)
    jobs = []
    for index, (job_id, name) in enumerate(leases):
        r = running(job_id, 2, started_h_ago=0.5, name=name)
        runners = lease_runners(runners, r, [2 * index + 1, 2 * index + 2])
        jobs.append(r)
    a = named(job(4, 8, score="3.000", age_s=int(a_age_h * 3600)), "a")
    c = named(job(5, 4, score="1.000"), "c-long")
    return snapshot(runners, [*jobs, a, c])


def test_reserve_runtime_quantile_picks_which_running_estimate_sets_the_trigger() -> None:
    knobs: dict[str, Any] = {
        "timeout_overrides": {"brief": 60, "medium": 120, "c-long": 570},
        "reserve_after_runtimes": 1.0,
    }
    # the median of 1, 2 and 8 h is 2 h: A, after 3 h, is reserved and C waits
    median = plan(three_running_and_a_wide_job(3), cfg("easy", **knobs), NOW)
    assert admitted(median) == {} and blocked(median)[5] == BlockReason.RESERVED
    # the top quantile is 8 h: A is not due yet, C backfills
    top = cfg("easy", reserve_runtime_quantile=1.0, **knobs)
    assert admitted(plan(three_running_and_a_wide_job(3), top, NOW)) == {5: 4}
    assert AdmissionSettings().reserve_runtime_quantile == 0.5


def test_backfill_order_shortest_takes_young_jobs_shortest_first_after_the_due_ones() -> None:
    knobs: dict[str, Any] = {
        "timeout_overrides": {"quick": 60, "slow": 480},
        "reserve_after_s": 5 * 3600,
    }
    # B (6 nodes, 8 h) outranks C (6 nodes, 1 h); only one fits on 10 runners
    b = named(job(1, 6, score="3.000"), "slow")
    c = named(job(2, 6, score="1.000"), "quick")
    young = snapshot(pool("x", 10), [b, c])
    assert admitted(plan(young, cfg("easy", **knobs), NOW)) == {1: 6}
    shortest = cfg("easy", backfill_order="shortest", **knobs)
    assert admitted(plan(young, shortest, NOW)) == {2: 6}
    # a job due a reservation (waited 6 h) still goes before the shorter young one
    old = snapshot(pool("x", 10), [replace(b, created_at=NOW - timedelta(hours=6)), c])
    assert admitted(plan(old, shortest, NOW)) == {1: 6}
    # with reservations at once (classic EASY) every job is due: the priority order stands
    classic = cfg("easy", backfill_order="shortest", timeout_overrides=knobs["timeout_overrides"])
    assert admitted(plan(young, classic, NOW)) == {1: 6}
    assert AdmissionSettings().backfill_order == "priority"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    worlds(),
    st.sampled_from(["easy", "conservative"]),
    st.sampled_from([1.0, 30.0, 480.0]),
    st.sampled_from([0.0, 600.0]),
    st.sampled_from([None, 0.5]),
    st.sampled_from([None, 0.5]),
    st.sampled_from(["priority", "shortest"]),
    st.sampled_from(["predicted", "timeout"]),
    st.sampled_from([None, 0.5]),
)
def test_capacity_invariant_and_fixed_point_for_every_policy(
    world: World,
    policy: str,
    timeout_min: float,
    reserve_after_s: float,
    reserve_slowdown: float | None,
    reserve_after_runtimes: float | None,
    backfill_order: str,
    backfill_bound: str,
    reserve_wide_frac: float | None,
) -> None:
    s = cfg(
        policy,
        timeout_min=timeout_min,
        reserve_after_s=reserve_after_s,
        reserve_slowdown=reserve_slowdown,
        reserve_after_runtimes=reserve_after_runtimes,
        backfill_order=backfill_order,
        backfill_bound=backfill_bound,
        reserve_wide_frac=reserve_wide_frac,
    )
    d = plan(world.snap, s, NOW)
    check_admissions(world.snap, d)
    decided = {a.job_id for a in d.admit} | {b.job_id for b in d.blocked}
    queued = {
        j.id
        for j in world.snap.jobs
        if j.status == JobStatus.QUEUED and j.id not in world.lease_jobs
    }
    assert decided == queued
    after = apply(world.snap, d)
    again = plan(after, s, NOW)
    assert again.release == () and again.clean == ()
    assert not {a.job_id for a in d.admit} & {a.job_id for a in again.admit}
    check_admissions(after, again)


def test_policy_for_applies_the_knobs() -> None:
    assert policy_for(cfg("conservative", reservation_depth=5)).depth == 5  # type: ignore[attr-defined]
    assert policy_for(cfg("easy"), "fcfs").name == "fcfs"
    assert policy_for(cfg("easy", reserve_after_s=60)).reserve_after_s == 60  # type: ignore[attr-defined]
    assert policy_for(cfg("easy")).reserve_after_s == 0  # type: ignore[attr-defined]
    assert policy_for(cfg("easy", reserve_slowdown=2)).reserve_slowdown == 2  # type: ignore[attr-defined]
    assert policy_for(cfg("conservative", reserve_slowdown=2)).reserve_slowdown == 2  # type: ignore[attr-defined]
    runtimes = policy_for(cfg("easy", reserve_after_runtimes=2, reserve_runtime_quantile=0.9))
    assert (runtimes.reserve_after_runtimes, runtimes.runtime_quantile) == (2, 0.9)  # type: ignore[attr-defined]
    assert policy_for(cfg("easy", backfill_order="shortest")).backfill_order == "shortest"  # type: ignore[attr-defined]
    assert policy_for(cfg("easy", backfill_bound="timeout")).backfill_bound == "timeout"  # type: ignore[attr-defined]
    assert policy_for(cfg("easy", reserve_wide_frac=0.3)).reserve_wide_frac == 0.3  # type: ignore[attr-defined]
    assert AdmissionSettings().reserve_after_s == 5 * 3600


def test_settings_read_the_estimate_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_POLICY", "conservative")
    monkeypatch.setenv("SLURMGATE_ESTIMATES", "timeout")
    monkeypatch.setenv("SLURMGATE_TIMEOUT_MIN", "60")
    monkeypatch.setenv("SLURMGATE_TIMEOUT_OVERRIDES", '{"Agentic": 780, "smoke": 10}')
    monkeypatch.setenv("SLURMGATE_RESERVE_AFTER_S", "900")
    s = AdmissionSettings()
    assert (s.policy, s.estimates, s.reserve_after_s) == ("conservative", "timeout", 900)
    assert s.timeout_s("bench (dsr1, AGENTIC)") == 780 * 60
    assert s.timeout_s("smoke-test") == 600
    assert s.timeout_s("other") == 3600


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("estimate_quantile", 0),
        ("estimate_quantile", 1.5),
        ("timeout_overrides", {"agentic": -1}),
        ("timeout_min", 0),
        ("reserve_after_s", -1),
        ("reserve_slowdown", -1),
        ("reserve_after_runtimes", -1),
        ("reserve_runtime_quantile", 0),
        ("reserve_runtime_quantile", 1.5),
        ("backfill_order", "fifo"),
        ("backfill_bound", "limit"),
        ("reserve_wide_frac", 0),
        ("reserve_wide_frac", 1.5),
        ("estimates", "oracle"),
    ],
)
def test_bad_estimate_knobs_name_the_field(knob: str, value: object) -> None:
    with pytest.raises(ValidationError, match=knob):
        AdmissionSettings.model_validate({knob: value})
