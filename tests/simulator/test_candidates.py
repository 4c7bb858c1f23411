"""Reservation methods (simulator candidates, the planner's wide-job rules) on small replays."""

from __future__ import annotations

from slurmgate.admission.policies import ReservationBackfill
from slurmgate.simulator.candidates import Predicted, TimeoutBound
from slurmgate.simulator.engine import controller_settings, sim_settings, simulate
from slurmgate.simulator.traces import Trace, TraceJob

H = 3600.0


def taught(r_nodes: int, c_nodes: int) -> list[TraceJob]:
    """Three rounds, 3 h apart, that teach the history that R (8 h timeout) runs 1.5 h and C
    (9.5 h timeout) 2 h."""
    jobs = []
    for round_ in range(3):
        at = round_ * 3 * H
        jobs.append(TraceJob(10 + round_, at, 1.5 * H, r_nodes, 8 * H, "r"))
        jobs.append(TraceJob(20 + round_, at, 2 * H, c_nodes, 9.5 * H, "c"))
    return jobs


def trace() -> Trace:
    """On 10 runners: three rounds teach the history that R (6 nodes, 8 h timeout) runs 1.5 h
    and C (4 nodes, 9.5 h timeout) 2 h; then R runs again, A (8 nodes) and C queue behind it."""
    jobs = taught(r_nodes=6, c_nodes=4)
    jobs.append(TraceJob(1, 9 * H, 1.5 * H, 6, 8 * H, "r"))
    jobs.append(TraceJob(2, 9 * H + 1, 1 * H, 8, 1 * H, "a"))
    jobs.append(TraceJob(3, 9 * H + 2, 2 * H, 4, 9.5 * H, "c"))
    return Trace("candidates", tuple(jobs))


def starts(policy: ReservationBackfill) -> dict[int, float]:
    result = simulate(
        trace(), {"cluster:p0": 10}, policy, estimates="learned", settings=sim_settings()
    )
    assert result.policy == "easy"
    return {r.job_id: r.start_s - 9 * H for r in result.runs if r.job_id < 10}


def test_planned_on_timeouts_c_backfills_and_a_waits_for_it() -> None:
    # A's reservation is at R's timeout (in 8 h): C, predicted 2 h, starts beside it at once
    assert starts(ReservationBackfill("easy", 1)) == {1: 0, 3: 2, 2: 2 * H + 2}


def test_planned_on_predictions_a_goes_first() -> None:
    # A's reservation is at R's predicted end (in 1.5 h): C's 2 h would delay it, so C waits
    planned = {1: 0, 2: 1.5 * H, 3: 2.5 * H}
    assert starts(Predicted("easy", 1)) == planned
    # a backfill checked for its 9.5 h timeout waits too
    assert starts(TimeoutBound("easy", 1)) == planned


def young_head(head_nodes: int) -> dict[int, float]:
    """On 10 runners: a long 10 h job and a 2 h job leave one runner free; a head (1 h) queues
    1 s later and a 1-node 5 h job 1 s after it, which would take a runner the head needs at
    the 2 h shadow. The start of each, replayed with the 1 h trigger and each method."""
    jobs = (  # the long job leaves the head exactly its nodes once the short one ends
        TraceJob(1, 0, 10 * H, 10 - head_nodes, 10 * H, "long"),
        TraceJob(2, 0, 2 * H, head_nodes - 1, 2 * H, "short"),
        TraceJob(3, 1, 1 * H, head_nodes, 1 * H, "head"),
        TraceJob(4, 2, 5 * H, 1, 5 * H, "small"),
    )
    out = {}
    for name, policy in (
        ("trigger", ReservationBackfill("easy", 1, H)),
        ("narrow", ReservationBackfill("easy", 1, H, wide_fraction=0.25)),
    ):
        result = simulate(
            Trace("young-head", jobs), {"cluster:p0": 10}, policy, settings=controller_settings()
        )
        out[name] = {r.job_id: r.start_s for r in result.runs if r.job_id >= 3}
    return out


def test_a_narrow_young_head_is_reserved_at_once() -> None:
    # 2 nodes (<= 0.25 of 10): the trigger lets the small job start and delay the head to its
    # end (5 h); reserved at once the head starts at the shadow and the small job after it
    starts = young_head(2)
    assert starts["trigger"] == {4: 2, 3: 5 * H + 2}
    assert starts["narrow"] == {3: 2 * H, 4: 3 * H}


def test_a_wide_young_head_still_waits_for_the_trigger() -> None:
    # 3 nodes (> 0.25 of 10): both methods let the small job start at once
    starts = young_head(3)
    assert starts["narrow"] == starts["trigger"] == {4: 2, 3: 5 * H + 2}


def beside_holder(wide_fraction: float | None) -> dict[int, float]:
    """On 12 runners: three rounds teach that R (2 nodes, 8 h timeout) runs 1.5 h and C (2
    nodes, 9.5 h timeout) 2 h. Then L holds 8 runners for 20 h and R runs again; A (3 nodes) is
    blocked and reserved at R's timeout, where one runner is left over beside it; C queues next
    and fits now on the 2 free runners only if it ends before A's reservation."""
    jobs = taught(r_nodes=2, c_nodes=2)
    jobs.append(TraceJob(5, 9 * H, 20 * H, 8, 20 * H, "l"))
    jobs.append(TraceJob(1, 9 * H, 1.5 * H, 2, 8 * H, "r"))
    jobs.append(TraceJob(2, 9 * H + 1, 1 * H, 3, 1 * H, "a"))
    jobs.append(TraceJob(3, 9 * H + 2, 2 * H, 2, 9.5 * H, "c"))
    policy = ReservationBackfill("easy", 1, 0.0, wide_fraction)
    result = simulate(
        Trace("holder", tuple(jobs)),
        {"cluster:p0": 12},
        policy,
        estimates="learned",
        settings=sim_settings(),
    )
    return {r.job_id: r.start_s - 9 * H for r in result.runs if r.job_id < 5}


def test_beside_a_narrow_reservation_a_backfill_is_taken_at_its_prediction() -> None:
    # A needs 3 of 12 (<= 0.25): C's 2 h prediction ends before A's reservation, so C starts
    # at once, as without the rule; A starts when C ends
    narrow = {1: 0, 3: 2, 2: 2 * H + 2}
    assert beside_holder(0.25) == narrow
    assert beside_holder(None) == narrow


def test_beside_a_wide_reservation_a_backfill_is_taken_at_its_timeout() -> None:
    # A needs 3 of 12 (> 0.2): C's 9.5 h timeout runs past A's reservation and A leaves only one
    # runner over, so C waits; A starts when R ends, C when A ends
    assert beside_holder(0.2) == {1: 0, 2: 1.5 * H, 3: 2.5 * H}
