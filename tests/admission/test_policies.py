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
from slurmgate.settings.admission import AdmissionSettings

DEFAULT_METHOD = ("learned", 3600.0, 0.25)  # benchmarks/bench_policies.py: chosen on KTH only


def cfg(policy: str, **knobs: Any) -> AdmissionSettings:
    return AdmissionSettings.model_validate(
        {
            "PRIORITY_SCHEDULER_ENABLED": True,
            "NODE_SLOT_SCHEDULER_ENABLED": True,
            "policy": policy,
            "estimates": "timeout",
            "reserve_after_s": 0,
            "wide_fraction": None,  # classic EASY unless a test asks for the wide-job rules
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


def test_reservations_are_planned_on_timeouts_and_a_backfill_on_its_prediction() -> None:
    # R (6 of 10) started 1 h ago: its key ran 1.5 h three times, its timeout is 8 h. A (8)
    # waits. C (4) ran 2 h three times, timeout 9.5 h.
    knobs: dict[str, Any] = {"estimates": "learned", "timeout_overrides": {"c-long": 570}}
    history = RuntimeHistory()
    for i in range(3):
        history.record(job_key("long", 6), 100 + i, 5400, 1000 + i)
        history.record(job_key("c-long", 4), 200 + i, 7200, 1000 + i)
    r = running(1, 6, started_h_ago=1)
    runners = lease_runners(pool("x", 10), r, list(range(1, 7)))
    a = named(job(2, 8, score="3.000"), "a")
    c = named(job(3, 4, score="1.000"), "c-long")
    snap = snapshot(runners, [r, a, c])
    # A is reserved where R's timeout ends (in 7 h), not at R's prediction (in 30 min), and C,
    # taken at its 2 h prediction, ends before that
    learned = plan(snap, cfg("easy", **knobs), NOW, history=history)
    assert admitted(learned) == {3: 4}
    assert "reserved cluster:x in 25200s" in {x.job_id: x.detail for x in learned.blocked}[2]
    # on timeouts alone C's 9.5 h would delay A: classic EASY holds it
    classic = plan(snap, cfg("easy", timeout_overrides=knobs["timeout_overrides"]), NOW)
    assert admitted(classic) == {} and blocked(classic)[3] == BlockReason.RESERVED
    default = AdmissionSettings()
    assert (default.estimates, default.reserve_after_s, default.wide_fraction) == DEFAULT_METHOD


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    worlds(),
    st.sampled_from(["easy", "conservative"]),
    st.sampled_from([1.0, 30.0, 480.0]),
    st.sampled_from([0.0, 600.0]),
    st.sampled_from(["timeout", "learned"]),
    st.sampled_from([None, 0.25, 1.0]),
)
def test_capacity_invariant_and_fixed_point_for_every_policy(
    world: World,
    policy: str,
    timeout_min: float,
    reserve_after_s: float,
    estimates: str,
    wide_fraction: float | None,
) -> None:
    s = cfg(
        policy,
        timeout_min=timeout_min,
        reserve_after_s=reserve_after_s,
        estimates=estimates,
        wide_fraction=wide_fraction,
    )
    # a learned estimate for every job key of the world: half its timeout
    history = RuntimeHistory()
    for j in world.snap.jobs:
        for n in range(1, 9):
            for k in range(3):
                history.record(job_key(j.name, n), 10_000 + k, timeout_min * 30, 1000 + k)
    d = plan(world.snap, s, NOW, history=history)
    check_admissions(world.snap, d)
    decided = {a.job_id for a in d.admit} | {b.job_id for b in d.blocked}
    queued = {
        j.id
        for j in world.snap.jobs
        if j.status == JobStatus.QUEUED and j.id not in world.lease_jobs
    }
    assert decided == queued
    after = apply(world.snap, d)
    again = plan(after, s, NOW, history=history)
    assert again.release == () and again.clean == ()
    assert not {a.job_id for a in d.admit} & {a.job_id for a in again.admit}
    check_admissions(after, again)


def test_policy_for_applies_the_knobs() -> None:
    assert policy_for(cfg("conservative", reservation_depth=5)).depth == 5  # type: ignore[attr-defined]
    assert policy_for(cfg("easy"), "fcfs").name == "fcfs"
    assert policy_for(cfg("easy", reserve_after_s=60)).reserve_after_s == 60  # type: ignore[attr-defined]
    assert policy_for(cfg("easy")).reserve_after_s == 0  # type: ignore[attr-defined]
    assert policy_for(cfg("conservative", reserve_after_s=60)).reserve_after_s == 60  # type: ignore[attr-defined]
    assert policy_for(cfg("easy", wide_fraction=0.25)).wide_fraction == 0.25  # type: ignore[attr-defined]
    assert policy_for(cfg("conservative", wide_fraction=0.5)).wide_fraction == 0.5  # type: ignore[attr-defined]


def test_wide_fraction_is_a_part_of_a_pool_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("0", "1.5", "-0.25", "wide"):
        monkeypatch.setenv("SLURMGATE_WIDE_FRACTION", bad)
        with pytest.raises(ValidationError, match="wide_fraction"):
            AdmissionSettings()
    monkeypatch.setenv("SLURMGATE_WIDE_FRACTION", "null")
    assert AdmissionSettings().wide_fraction is None


def test_settings_read_the_estimate_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_POLICY", "conservative")
    monkeypatch.setenv("SLURMGATE_ESTIMATES", "timeout")
    monkeypatch.setenv("SLURMGATE_TIMEOUT_MIN", "60")
    monkeypatch.setenv("SLURMGATE_TIMEOUT_OVERRIDES", '{"Agentic": 780, "smoke": 10}')
    monkeypatch.setenv("SLURMGATE_RESERVE_AFTER_S", "900")
    monkeypatch.setenv("SLURMGATE_WIDE_FRACTION", "0.5")
    s = AdmissionSettings()
    assert (s.policy, s.estimates, s.reserve_after_s) == ("conservative", "timeout", 900)
    assert s.wide_fraction == 0.5
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
        ("estimates", "oracle"),
    ],
)
def test_bad_estimate_knobs_name_the_field(knob: str, value: object) -> None:
    with pytest.raises(ValidationError, match=knob):
        AdmissionSettings.model_validate({knob: value})
