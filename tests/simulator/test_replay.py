"""Replays through the planner's policies: hand-computed schedules, plan() equivalence, and an
independent textbook EASY/greedy on a KTH prefix."""

from __future__ import annotations

import heapq

import pytest

from slurmgate.simulator.engine import (
    SimulationError,
    parse_pools,
    sim_settings,
    simulate,
    simulate_via_plan,
)
from slurmgate.simulator.traces import TRACES, Trace, TraceJob, read_trace

POOL16 = {"cluster:p0": 16}


def tj(
    job_id: int, submit: float, runtime: float, nodes: int, limit: float | None = None
) -> TraceJob:
    return TraceJob(job_id, submit, runtime, nodes, limit or runtime, key=f"k{job_id}")


def starts(result: object) -> dict[int, float]:
    return {r.job_id: r.start_s for r in result.runs}  # type: ignore[attr-defined]


def anchor_trace(b_runtime: float) -> Trace:
    """scheduling-anchors 2.3: an 8-node job runs until 100; A (9 nodes) then B (8) queue."""
    return Trace("anchor", (tj(1, 0, 100, 8), tj(2, 1, 500, 9), tj(3, 2, b_runtime, 8)))


@pytest.mark.parametrize("driver", [simulate, simulate_via_plan])
def test_seed_greedy_lets_b_take_the_remainder_and_a_waits_for_both(driver: object) -> None:
    result = driver(anchor_trace(1000), POOL16, "greedy")  # type: ignore[operator]
    assert starts(result) == {1: 0, 3: 2, 2: 1002}


@pytest.mark.parametrize("driver", [simulate, simulate_via_plan])
@pytest.mark.parametrize("policy", ["easy", "conservative"])
def test_reservation_starts_a_at_100_and_b_only_after_a(driver: object, policy: str) -> None:
    result = driver(anchor_trace(1000), POOL16, policy)  # type: ignore[operator]
    # B (8 > the 7 nodes A leaves over, and it would run past 100) must not backfill
    assert starts(result) == {1: 0, 2: 100, 3: 600}


@pytest.mark.parametrize("policy", ["greedy", "easy", "conservative"])
def test_short_b_backfills_before_the_reservation(policy: str) -> None:
    result = simulate(anchor_trace(50), POOL16, policy)
    assert starts(result) == {1: 0, 3: 2, 2: 100}


def test_fcfs_never_backfills() -> None:
    result = simulate(anchor_trace(50), POOL16, "fcfs")
    assert starts(result) == {1: 0, 2: 100, 3: 600}


def test_learned_estimate_that_is_too_short_never_overfills_a_pool() -> None:
    # job key k repeats: three 10 s runs teach a 10 s estimate, then a run takes 1000 s
    jobs = [TraceJob(i, i * 20.0, 10, 4, 2000, key="k") for i in range(1, 4)]
    jobs += [TraceJob(4, 100, 1000, 4, 2000, key="k"), TraceJob(5, 101, 50, 4, 2000, key="w")]
    jobs += [TraceJob(6, 102, 30, 1, 40, key="s")]
    result = simulate(Trace("overrun", tuple(jobs)), {"cluster:p0": 6}, "easy", estimates="learned")
    got = starts(result)
    assert got[4] == 100
    # 5 (4 nodes) reserves for when 4 is expected to end; 6 ends before that and backfills
    assert got[6] == 102 and got[5] == 1100
    timeline = sorted(
        [(r.start_s, r.nodes) for r in result.runs] + [(r.end_s, -r.nodes) for r in result.runs],
        key=lambda e: (e[0], e[1]),
    )
    used = 0
    for _, delta in timeline:
        used += delta
        assert used <= 6


def test_jobs_wider_than_every_pool_are_rejected_not_queued() -> None:
    trace = Trace("wide", (tj(1, 0, 10, 20), tj(2, 0, 10, 4)))
    result = simulate(trace, POOL16, "easy")
    assert result.rejected == (1,) and starts(result) == {2: 0}


def test_bad_options_name_the_flag() -> None:
    trace = anchor_trace(10)
    with pytest.raises(SimulationError, match="--policy"):
        simulate(trace, POOL16, "sjf")
    with pytest.raises(SimulationError, match="--estimates"):
        simulate(trace, POOL16, "easy", estimates="oracle")
    with pytest.raises(SimulationError, match="--pools entry 'x'"):
        parse_pools("100,x", trace)
    with pytest.raises(SimulationError, match="--pools is required"):
        parse_pools(None, trace)
    assert parse_pools("32,16", trace) == ({"cluster:p0": 32, "cluster:p1": 16}, False)


# ---- KTH prefix: the fast driver, plan() on labels, and an independent textbook scheduler ----

KTH_PREFIX = 300


@pytest.fixture(scope="module")
def kth_prefix() -> Trace:
    return read_trace(TRACES / "KTH-SP2-1996-2.1-cln.swf.gz", limit=KTH_PREFIX)


def textbook(trace: Trace, capacity: int, easy: bool) -> dict[int, float]:
    """Greedy first-fit or Lifka's EASY (shadow time and extra nodes), one pool, FCFS order."""
    queue: list[TraceJob] = []
    running: list[tuple[float, float, int]] = []  # (end, limit end, nodes)
    free = capacity
    out: dict[int, float] = {}
    pending = list(trace.jobs)
    pending.reverse()
    while pending or running:
        now = min(
            pending[-1].submit_s if pending else float("inf"),
            running[0][0] if running else float("inf"),
        )
        while running and running[0][0] <= now:
            free += heapq.heappop(running)[2]
        while pending and pending[-1].submit_s <= now:
            queue.append(pending.pop())
        shadow, extra = None, 0
        waiting: list[TraceJob] = []
        for job in queue:
            if shadow is None:
                if job.nodes <= free:
                    start = True
                else:
                    start = False
                    if easy:
                        # shadow: the first end at which enough runners are free; extra: what
                        # is free then beyond the head's need (every job ending then counts)
                        avail = free
                        for _, limit_end, nodes in sorted(running, key=lambda r: r[1]):
                            if shadow is not None and limit_end > shadow:
                                break
                            avail += nodes
                            if shadow is None and avail >= job.nodes:
                                shadow = limit_end
                        if shadow is not None:
                            extra = avail - job.nodes
            else:
                start = job.nodes <= free and (now + job.limit_s <= shadow or job.nodes <= extra)
                if start and now + job.limit_s > shadow:
                    extra -= job.nodes
            if start:
                free -= job.nodes
                out[job.id] = now
                heapq.heappush(running, (now + job.runtime_s, now + job.limit_s, job.nodes))
            else:
                waiting.append(job)
        queue = waiting
    return out


@pytest.mark.parametrize("policy", ["greedy", "easy"])
def test_kth_prefix_matches_an_independent_textbook_scheduler(
    kth_prefix: Trace, policy: str
) -> None:
    expected = textbook(kth_prefix, 100, easy=policy == "easy")
    assert len(expected) == KTH_PREFIX
    assert starts(simulate(kth_prefix, {"cluster:p0": 100}, policy)) == expected


@pytest.mark.parametrize("policy", ["greedy", "easy", "conservative"])
@pytest.mark.parametrize("estimates", ["timeout", "learned"])
def test_kth_prefix_through_plan_on_labels_gives_the_same_schedule(
    kth_prefix: Trace, policy: str, estimates: str
) -> None:
    settings = sim_settings(reserve_after_s=3600.0)
    pools = {"cluster:p0": 60, "cluster:p1": 40}
    fast = simulate(kth_prefix, pools, policy, estimates=estimates, settings=settings)
    slow = simulate_via_plan(kth_prefix, pools, policy, estimates=estimates, settings=settings)
    assert sorted((r.job_id, r.start_s, r.runner_ids) for r in fast.runs) == sorted(
        (r.job_id, r.start_s, r.runner_ids) for r in slow.runs
    )
    assert fast.rejected == slow.rejected
