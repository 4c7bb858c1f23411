"""Planner invariants over random fleets, leases and job mixes (hypothesis)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import timedelta

from admission_kit import NOW, ON, apply, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmgate.admission.labels import fold, is_managed, unmanaged
from slurmgate.admission.model import Decisions, Job, JobStatus, Runner, Snapshot, leases_from_fleet
from slurmgate.admission.planner import plan

SCORES = ["0.000", "0.998", "1.000", "1.250", "3.000"]
MALFORMED = ["nodes:", "nodes:0", "nodes:-2", "nodes:1.5", "nodes:x"]
LEASE_STATUSES = [JobStatus.QUEUED, JobStatus.IN_PROGRESS, JobStatus.COMPLETED]


@dataclass
class World:
    snap: Snapshot
    lease_jobs: set[int]


@st.composite
def worlds(draw: st.DrawFn) -> World:
    pool_count = draw(st.integers(1, 3))
    runners: list[Runner] = []
    rid = 1
    for p in range(pool_count):
        for _ in range(draw(st.integers(1, 20))):
            online = draw(st.booleans()) or draw(st.booleans())  # mostly online
            busy = draw(st.integers(0, 4)) == 0
            runners.append(
                Runner(rid, f"p{p}-{rid}", online, busy, ("self-hosted", f"cluster:p{p}"))
            )
            rid += 1
    for _ in range(draw(st.integers(0, 3))):
        runners.append(Runner(rid, f"legacy-{rid}", draw(st.booleans()), False, ("self-hosted",)))
        rid += 1

    jobs: list[Job] = []
    job_id = 1000
    taken: set[int] = set()
    lease_jobs: set[int] = set()
    by_index = {r.id: i for i, r in enumerate(runners)}
    for _ in range(draw(st.integers(0, 4))):  # existing, valid leases
        p = draw(st.integers(0, pool_count - 1))
        members = [r.id for r in runners if r.pool == f"cluster:p{p}" and r.id not in taken]
        if not members:
            continue
        size = draw(st.integers(1, len(members)))
        ids = sorted(draw(st.permutations(members))[:size])
        status = draw(st.sampled_from(LEASE_STATUSES))
        age = draw(st.integers(0, 7200))
        job_id += 1
        gate = (f"ci-job-1.000-l{job_id}", "ci-attempt-1", f"nodes:{size}")
        the_job = Job(
            job_id,
            job_id,
            1,
            f"leased-{job_id}",
            ("self-hosted", f"cluster:p{p}", *gate),
            status,
            NOW - timedelta(seconds=age),
        )
        if draw(st.integers(0, 5)) > 0:
            jobs.append(the_job)
        label = f"ci-lease-j{job_id}-a1-t{int(NOW.timestamp()) - age}"
        for member in ids:
            i = by_index[member]
            extra = (label, *gate) if member == ids[0] else (label,)
            runners[i] = replace(runners[i], labels=(*runners[i].labels, *extra))
        taken.update(ids)
        lease_jobs.add(job_id)

    skip_queue: set[int] = set()
    for _ in range(draw(st.integers(0, 15))):  # queued jobs
        job_id += 1
        target = draw(st.sampled_from([None, *[f"cluster:p{p}" for p in range(pool_count)]]))
        nodes = draw(st.integers(1, 22))
        nodes_label = draw(st.sampled_from(MALFORMED)) if draw(st.integers(0, 9)) == 0 else None
        labels = ["self-hosted", f"ci-job-{draw(st.sampled_from(SCORES))}-q{job_id}"]
        labels += ["ci-attempt-1", nodes_label or f"nodes:{nodes}"]
        if target:
            labels.append(target)
        if draw(st.integers(0, 3)) == 0:  # a skip-queue job, verified or not
            labels.append(f"ci-skip-queue-pr-{draw(st.integers(1, 3))}")
            if draw(st.booleans()):
                skip_queue.add(job_id)
        jobs.append(
            Job(
                job_id,
                job_id,
                1,
                f"queued-{job_id}",
                tuple(labels),
                JobStatus.QUEUED,
                NOW - timedelta(seconds=draw(st.integers(0, 600))),
            )
        )
    snap = replace(snapshot(runners, jobs), skip_queue_job_ids=frozenset(skip_queue))
    return World(snap, lease_jobs)


def check_admissions(snap: Snapshot, d: Decisions) -> None:
    runners = {r.id: r for r in snap.runners}
    jobs = {j.id: j for j in snap.jobs}
    leases, _ = leases_from_fleet(snap.runners)
    released = {r.lease_label for r in d.release}
    holding = {rid for lease in leases for rid in lease.runner_ids}
    in_use: dict[str, int] = defaultdict(int)
    for lease in leases:
        if lease.label not in released and lease.pool is not None:
            in_use[lease.pool] += max(lease.size, lease.requested_nodes or 0)
    online: dict[str, int] = defaultdict(int)
    for r in snap.runners:
        if r.pool is not None and r.online:
            online[r.pool] += 1

    used: set[int] = set()
    admitted: dict[str, int] = defaultdict(int)
    for a in d.admit:
        job = jobs[a.job_id]
        assert len(a.runner_ids) == a.nodes == len(set(a.runner_ids))
        assert a.anchor_id in a.runner_ids
        assert not used & set(a.runner_ids), "a runner in two new leases"
        assert not holding & set(a.runner_ids), "a runner already holding a lease"
        used |= set(a.runner_ids)
        need = unmanaged(job.labels)
        for rid in a.runner_ids:
            r = runners[rid]
            assert r.pool == a.pool, "lease spans pools"
            assert r.online and not r.busy and not r.misconfigured
            assert need <= r.folded, "runner lacks a label the job asks for"
        if a.pool is None:
            assert a.nodes == 1, "legacy runners serve 1-node jobs only"
        else:
            admitted[a.pool] += a.nodes
        assert a.anchor_labels == tuple(job.gate_labels())
    for name, nodes in admitted.items():
        assert in_use[name] + nodes <= online[name], f"{name} over-admitted"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_capacity_invariant_one_pool_per_lease_and_no_double_lease(world: World) -> None:
    d = plan(world.snap, ON, NOW)
    check_admissions(world.snap, d)
    removed = [x for r in d.release for _, labels in r.labels for x in labels]
    removed += [x for c in d.clean for x in c.labels]
    assert all(is_managed(x) for x in removed), "only managed labels are ever removed"
    decided = {a.job_id for a in d.admit} | {b.job_id for b in d.blocked}
    managed_queued = {
        j.id
        for j in world.snap.jobs
        if j.status == JobStatus.QUEUED and j.id not in world.lease_jobs
    }
    assert decided == managed_queued, "every queued managed job is admitted or blocked"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_applying_decisions_then_replanning_is_a_fixed_point(world: World) -> None:
    d = plan(world.snap, ON, NOW)
    after = apply(world.snap, d)
    again = plan(after, ON, NOW)
    assert again.release == ()
    assert again.clean == ()
    assert not {a.job_id for a in d.admit} & {a.job_id for a in again.admit}
    check_admissions(after, again)
    # and whatever the second plan admits leaves no runner in two leases
    final = apply(after, again)
    for r in final.runners:
        assert len({fold(x) for x in r.labels if fold(x).startswith("ci-lease-")}) <= 1
