"""Fairness between repositories: score ceilings, repository and team node quotas, and the
fair-share order of equal scores; the capacity invariant holds with them (hypothesis)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from admission_kit import NOW, ON, apply, job, lease_runners, pool, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from slurmgate.admission.model import Decisions, Job, JobStatus, Snapshot, leases_from_fleet
from slurmgate.admission.planner import plan
from slurmgate.blocks import AdmissionPolicyBlock
from slurmgate.settings.admission import AdmissionSettings


def rules(**knobs: object) -> AdmissionSettings:
    return AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        **knobs,  # type: ignore[arg-type]
    )


def of_repos(snap: Snapshot, repos: dict[int, str]) -> Snapshot:
    return replace(snap, job_repos=repos)


def admitted(decisions: Decisions) -> list[int]:
    return [a.job_id for a in decisions.admit]


def blocked(decisions: Decisions) -> dict[int, str]:
    return {b.job_id: b.reason.value for b in decisions.blocked}


# ---- score ceilings --------------------------------------------------------------------------


def test_a_score_above_the_repositorys_ceiling_counts_as_the_ceiling() -> None:
    """Any repository can write ci-job-9.999; with a ceiling of 3 it is a 3, and a 5.000 of
    another repository goes first."""
    runners = pool("x", 4)
    greedy = job(1, 4, score="9.999", age_s=60)
    modest = job(2, 4, score="5.000")
    snap = of_repos(snapshot(runners, [greedy, modest]), {1: "acme/greedy", 2: "acme/modest"})
    assert admitted(plan(snap, ON, NOW)) == [1]  # without rules the label decides
    capped = rules(repo_limits={"acme/greedy": {"max_score": 3}})
    decisions = plan(snap, capped, NOW)
    assert admitted(decisions) == [2]
    assert blocked(decisions) == {1: "no-free-capacity"}
    assert any(
        "9.999 capped to 3.000 by repo_limits[acme/greedy].max_score" in n for n in decisions.notes
    )


def test_the_lower_of_repository_team_and_star_ceilings_holds() -> None:
    runners = pool("x", 1)
    jobs = [job(1, 1, score="4.000"), job(2, 1, score="2.500", age_s=5)]
    snap = of_repos(snapshot(runners, jobs), {1: "acme/a", 2: "acme/b"})
    team = rules(teams={"infra": {"repos": ["acme/a"], "max_score": 2}})
    # acme/a's 4.000 counts 2.000 under its team's ceiling: acme/b's 2.500 goes first
    decisions = plan(snap, team, NOW)
    assert admitted(decisions) == [2]
    star = rules(repo_limits={"*": {"max_score": 1.5}, "acme/b": {"max_score": 9}})
    # * caps every repository not named: acme/a is 1.500, acme/b keeps 2.500
    assert admitted(plan(snap, star, NOW)) == [2]
    [admit] = plan(snap, rules(repo_limits={"*": {"max_score": 1}}), NOW).admit
    # both capped to 1.000: fewer nodes tie, so the older job 2 goes, and the reason says why
    assert admit.job_id == 2 and "2.500 capped to 1.000 by repo_limits[*].max_score" in admit.reason


# ---- node quotas -----------------------------------------------------------------------------


def test_a_job_that_would_take_its_repository_past_its_quota_waits_with_repo_quota() -> None:
    runners = pool("x", 16)
    running = job(1, 6, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(runners, running, [1, 2, 3, 4, 5, 6])
    jobs = [running, job(2, 4, age_s=30), job(3, 2, age_s=20), job(4, 4, age_s=10)]
    snap = of_repos(snapshot(runners, jobs), {1: "acme/a", 2: "acme/a", 3: "acme/a", 4: "acme/b"})
    quota = rules(repo_limits={"acme/a": {"max_nodes": 8}})
    decisions = plan(snap, quota, NOW)
    # acme/a holds 6 of 8: its 2-node job (fewer nodes go first) fills the quota and its
    # 4-node job waits; acme/b's job has its own room
    assert sorted(admitted(decisions)) == [3, 4]
    [wait] = [b for b in decisions.blocked if b.job_id == 2]
    assert wait.reason.value == "repo-quota" and wait.pool == "cluster:x"
    assert "repository acme/a holds 8 of its 8 nodes (repo_limits[acme/a].max_nodes)" in wait.detail
    [row] = decisions.board_rows()
    assert "job 2 (4n): repo-quota acme/a 8/8" in str(row["blocked"])
    assert sorted(admitted(plan(snap, ON, NOW))) == [2, 3, 4]  # no quota: room for all


def test_one_plan_never_overshoots_a_quota_and_a_job_wider_than_it_never_starts() -> None:
    runners = pool("x", 20)
    jobs = [job(1, 6, age_s=30), job(2, 6, age_s=20), job(3, 9, score="2.000")]
    snap = of_repos(snapshot(runners, jobs), {1: "acme/a", 2: "acme/a", 3: "acme/a"})
    decisions = plan(snap, rules(repo_limits={"acme/a": {"max_nodes": 8}}), NOW)
    assert admitted(decisions) == [1]  # the first 6 counts against the quota at once
    waits = {b.job_id: b.detail for b in decisions.blocked}
    assert "acme/a holds 6 of its 8 nodes" in waits[2]
    assert "needs 9, more than repository acme/a may hold at all (8 nodes" in waits[3]
    # max_nodes 0: none of the repository's jobs is admitted, the others' are
    shut = rules(repo_limits={"*": {"max_nodes": 0}, "acme/b": {}})
    other = of_repos(snapshot(runners, [*jobs, job(4, 2)]), {1: "acme/a", 4: "acme/b"})
    assert admitted(plan(other, shut, NOW)) == [4]


def test_a_team_quota_is_shared_by_its_repositories() -> None:
    runners = pool("x", 20)
    running = job(1, 5, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(runners, running, [1, 2, 3, 4, 5])
    jobs = [running, job(2, 4, age_s=20), job(3, 3, age_s=10)]
    snap = of_repos(snapshot(runners, jobs), {1: "acme/a", 2: "acme/b", 3: "acme/b"})
    team = rules(teams={"serving": {"repos": ["acme/a", "acme/b"], "max_nodes": 9}})
    decisions = plan(snap, team, NOW)
    # the team holds 5 of 9 (acme/a's lease): acme/b's 3 fits (and is shorter), then 4 cannot
    assert admitted(decisions) == [3]
    [wait] = decisions.blocked
    assert wait.reason.value == "team-quota" and wait.scope == "serving 8/9"
    assert (
        "team serving (acme/b's) holds 8 of its 9 nodes (teams[serving].max_nodes)" in wait.detail
    )


def test_an_unknown_repository_is_held_to_the_star_limits() -> None:
    # a job whose repository the read could not tell must not slip past every quota
    snap = snapshot(pool("x", 8), [job(1, 4), job(2, 4, age_s=5)])
    decisions = plan(snap, rules(repo_limits={"*": {"max_nodes": 4}}), NOW)
    assert len(decisions.admit) == 1
    assert "(unknown repository)" in decisions.blocked[0].detail


# ---- the fair-share order --------------------------------------------------------------------


def test_repositories_of_equal_score_take_turns_fewest_nodes_held_first() -> None:
    runners = pool("x", 12)
    running = job(1, 6, status=JobStatus.IN_PROGRESS)
    runners = lease_runners(runners, running, list(range(1, 7)))
    # acme/a holds 6 nodes and its jobs are older; acme/b holds none
    jobs = [running, job(2, 2, age_s=50), job(3, 2, age_s=40), job(4, 2, age_s=1), job(5, 2)]
    repos = {1: "acme/a", 2: "acme/a", 3: "acme/a", 4: "acme/b", 5: "acme/b"}
    snap = of_repos(snapshot(runners, jobs), repos)
    # 6 free runners: without fair share the oldest go first (a, a, b); with it, b catches up
    # to a's 6 nodes first (b, b), then a and b alternate from equal footing
    unfair = plan(snap, rules(fair_share=False), NOW)
    assert admitted(unfair) == [2, 3, 4]
    assert admitted(plan(snap, ON, NOW)) == [4, 5, 2]
    # a larger share lets a repository hold more before it yields its turn: acme/a's 6 nodes
    # over a share of 4 are 1.5, so after acme/b's first job (2) it goes, then both are at 2
    # and the older job breaks the tie
    shares = rules(repo_limits={"acme/a": {"share": 4}})
    assert admitted(plan(snap, shares, NOW)) == [4, 2, 3]


def test_fair_share_never_reorders_different_scores_or_skip_queue() -> None:
    runners = pool("x", 2)
    jobs = [job(1, 1, score="1.000"), job(2, 1, score="2.000"), job(3, 1, score="2.000")]
    snap = replace(
        of_repos(snapshot(runners, jobs), {1: "acme/b", 2: "acme/a", 3: "acme/a"}),
        skip_queue_job_ids=frozenset({1}),
    )
    assert admitted(plan(snap, ON, NOW)) == [1, 2]


# ---- where the rules live ----------------------------------------------------------------------


def test_the_rules_come_from_the_environment_and_the_policy_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURMGATE_REPO_LIMITS", '{"Acme/A": {"max_score": 3, "max_nodes": 8}}')
    monkeypatch.setenv("SLURMGATE_TEAMS", '{"infra": {"repos": ["acme/a", "acme/b"]}}')
    monkeypatch.setenv("SLURMGATE_FAIR_SHARE", "false")
    env = AdmissionSettings()
    limits = env.repo_limits["acme/a"]
    assert (limits.max_nodes, str(limits.max_score)) == (8, "3.000")
    assert env.teams["infra"].repos == ["acme/a", "acme/b"] and env.fair_share is False
    # a policy block's rules win over the worker's environment, whole: nothing is merged in
    block = AdmissionPolicyBlock(repo_limits={"acme/c": {"max_nodes": 2}})
    mine = block.to_settings()
    assert list(mine.repo_limits) == ["acme/c"] and mine.teams == {} and mine.fair_share
    assert AdmissionPolicyBlock.from_settings(env).to_settings().repo_limits == env.repo_limits


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"repo_limits": {"not-a-repo": {}}}, "'not-a-repo' is not a repository; write it OWNER"),
        ({"repo_limits": {"a/b": {"max_nodes": -1}}}, "max_nodes"),
        ({"repo_limits": {"a/b": {"max_score": 1}, "A/B": {}}}, "names a/b twice"),
        ({"repo_limits": {"a/b": {"quota": 3}}}, "quota"),
        ({"teams": {"t": {"repos": ["a/b"]}, "u": {"repos": ["A/b"]}}}, "a/b is in both t and u"),
        ({"teams": {"t": {"repos": []}}}, "repos"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(knobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AdmissionSettings(**knobs)
    with pytest.raises(ValueError, match=message):
        AdmissionPolicyBlock(**knobs)


# ---- invariants over random fleets (hypothesis) --------------------------------------------------

REPOS = ["acme/a", "acme/b", "acme/c"]


@st.composite
def fair_worlds(draw: st.DrawFn) -> tuple[Snapshot, AdmissionSettings]:
    runners = []
    rid = 1
    for p in range(draw(st.integers(1, 2))):
        size = draw(st.integers(1, 12))
        runners += pool(
            f"p{p}", size, rid, offline=set(draw(st.sets(st.integers(rid, rid + size))))
        )
        rid += size
    jobs: list[Job] = []
    repos: dict[int, str] = {}
    taken: set[int] = set()
    for i in range(draw(st.integers(0, 3))):  # running leases
        free = [r.id for r in runners if r.id not in taken]
        if not free:
            break
        pool_of = next(r.pool for r in runners if r.id == free[0])
        ids = [r.id for r in runners if r.pool == pool_of and r.id not in taken]
        ids = ids[: draw(st.integers(1, len(ids)))]
        taken |= set(ids)
        running = job(900 + i, len(ids), pool_name=pool_of[8:], status=JobStatus.IN_PROGRESS)
        runners = lease_runners(runners, running, ids)
        jobs.append(running)
        repos[running.id] = draw(st.sampled_from(REPOS))
    for j in range(draw(st.integers(0, 10))):
        queued = job(
            j + 1,
            draw(st.integers(1, 8)),
            pool_name=f"p{draw(st.integers(0, 1))}",
            score=draw(st.sampled_from(["1.000", "2.000", "9.999"])),
            age_s=draw(st.integers(0, 600)),
        )
        jobs.append(queued)
        repos[queued.id] = draw(st.sampled_from(REPOS))
    quota = st.none() | st.integers(0, 10)
    limits = {
        repo: {"max_nodes": draw(quota), "max_score": draw(st.sampled_from([None, 1, 2]))}
        for repo in draw(st.sets(st.sampled_from(REPOS)))
    }
    team = draw(st.none() | st.integers(0, 12))
    knobs = AdmissionSettings(
        PRIORITY_SCHEDULER_ENABLED=True,
        NODE_SLOT_SCHEDULER_ENABLED=True,
        policy=draw(st.sampled_from(["greedy", "easy", "conservative"])),
        repo_limits=limits,
        teams={"ab": {"repos": ["acme/a", "acme/b"], "max_nodes": team}},
    )
    return of_repos(snapshot(runners, jobs), repos), knobs


def _held(snap: Snapshot) -> tuple[dict[str, int], dict[str, int]]:
    """Nodes held per repository and per pool, from the fleet's leases (as capacity counts)."""
    leases, _ = leases_from_fleet(snap.runners)
    by_repo: dict[str, int] = defaultdict(int)
    by_pool: dict[str, int] = defaultdict(int)
    for lease in leases:
        nodes = max(lease.size, lease.requested_nodes or 0)
        by_repo[snap.job_repos[lease.job_id]] += nodes
        by_pool[lease.pool or ""] += nodes
    return by_repo, by_pool


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fair_worlds())
def test_no_plan_admits_past_capacity_or_a_quota(world: tuple[Snapshot, AdmissionSettings]) -> None:
    snap, knobs = world
    decisions = plan(snap, knobs, NOW)
    before, _ = _held(snap)
    after, per_pool = _held(apply(snap, decisions))
    # capacity: a pool's leases never hold more than its online runners
    online: dict[str, int] = defaultdict(int)
    for runner in snap.runners:
        online[runner.pool or ""] += int(runner.online)
    for name, nodes in per_pool.items():
        assert nodes <= max(online[name], _held(snap)[1].get(name, 0))
    # quotas: a repository (or the team) that gained nodes stays within its quota
    for repo in REPOS:
        quota = knobs.repo_limits.get(repo)
        if quota is not None and quota.max_nodes is not None and after[repo] > before[repo]:
            assert after[repo] <= quota.max_nodes
    team = knobs.teams["ab"].max_nodes
    gained = sum(after[r] - before[r] for r in ("acme/a", "acme/b"))
    if team is not None and gained > 0:
        assert after["acme/a"] + after["acme/b"] <= team
    # every quota-blocked job really lacked room
    for b in decisions.blocked:
        if b.reason.value == "repo-quota":
            repo = snap.job_repos[b.job_id]
            limit = knobs.repo_limits[repo].max_nodes
            assert limit is not None and after[repo] + (b.nodes or 0) > limit
