"""Fairness between repositories: score ceilings, node quotas, and a fair-share order of ties.

A job declares its own priority in its `ci-job-<score>` label, so on an organisation's shared
pools any repository could write `ci-job-9.999`. The rules here come from the policy
(`AdmissionSettings.repo_limits`, `teams`, `fair_share`) and are applied by the planner in
three steps, before and during the policy's walk:

1. `cap_scores`: a job's score above its repository's or team's `max_score` counts as that
   ceiling (the lower of the two).
2. `fair_share_order`: the queue in the policy's priority order (`policies.priority_order`),
   except that among jobs of equal score the repositories take turns: the one whose leases
   hold the fewest nodes per unit of its `share` goes next, counting each job it is given as
   held (the order is made before the policy fits anything). The policy consumes the result
   as an ordered queue; one repository alone, or jobs of unknown repository, keep the
   priority order exactly.
3. `QuotaBook`, the fleet's `AdmissionGate`: a job that would take its repository past its
   `max_nodes`, or its team past the team's, waits with `repo-quota` or `team-quota`; an
   admission counts against both at once, so one walk never overshoots a quota.

A repository not named in `repo_limits` gets the `*` entry's limits, each on its own; a job
whose repository is unknown is held to them too. Quotas count the nodes a repository's kept
leases hold (as capacity does: a lease's runners, or its `nodes:N` if larger).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal

from slurmgate.admission.capacity import FleetState, JobRequest
from slurmgate.admission.model import Blocked, BlockReason, Lease
from slurmgate.admission.policies import priority_order
from slurmgate.settings.admission import (
    ANY_REPO,
    AdmissionSettings,
    RepoLimits,
    TeamLimits,
)

UNKNOWN_REPO = "(unknown repository)"
"""How a job whose repository the snapshot does not know is named in reasons and notes."""


@dataclass(frozen=True)
class Fairness:
    """The fairness rules of a policy: limits by repository, and each repository's team."""

    repo_limits: Mapping[str, RepoLimits]
    teams: Mapping[str, TeamLimits]
    team_of: Mapping[str, str]

    @classmethod
    def of(cls, settings: AdmissionSettings) -> Fairness:
        team_of = {repo: team for team, limits in settings.teams.items() for repo in limits.repos}
        return cls(settings.repo_limits, settings.teams, team_of)

    @property
    def has_quotas(self) -> bool:
        quotas = [x.max_nodes for x in self.repo_limits.values()]
        quotas += [x.max_nodes for x in self.teams.values()]
        return any(quota is not None for quota in quotas)

    def limits(self, repo: str | None) -> RepoLimits | None:
        """The repository's own limits, else the `*` entry's."""
        if repo is not None and repo in self.repo_limits:
            return self.repo_limits[repo]
        return self.repo_limits.get(ANY_REPO)

    def team(self, repo: str | None) -> str | None:
        return self.team_of.get(repo) if repo is not None else None

    def share(self, repo: str | None) -> float:
        limits = self.limits(repo)
        return limits.share if limits is not None else 1.0

    def ceiling(self, repo: str | None) -> tuple[Decimal, str] | None:
        """The lowest score ceiling that holds for the repository, and the rule that sets it."""
        found: list[tuple[Decimal, str]] = []
        limits = self.limits(repo)
        if limits is not None and limits.max_score is not None:
            named = repo if repo is not None and repo in self.repo_limits else ANY_REPO
            found.append((limits.max_score, f"repo_limits[{named}].max_score"))
        team = self.team(repo)
        if team is not None and self.teams[team].max_score is not None:
            ceiling = self.teams[team].max_score
            assert ceiling is not None
            found.append((ceiling, f"teams[{team}].max_score"))
        return min(found) if found else None


def repo_usage(
    leases: Iterable[Lease], job_repos: Mapping[int, str], node_slots: bool
) -> dict[str | None, int]:
    """Nodes the kept leases hold, by their job's repository (None: unknown), counted as
    capacity counts them: the lease's runners, or its anchor's `nodes:N` when larger."""
    held: dict[str | None, int] = defaultdict(int)
    for lease in leases:
        requested = (lease.requested_nodes or 0) if node_slots else 1
        held[job_repos.get(lease.job_id)] += max(lease.size, requested)
    return dict(held)


def cap_scores(
    requests: Sequence[JobRequest], fairness: Fairness
) -> tuple[list[JobRequest], dict[int, str]]:
    """The requests with every score above its ceiling lowered to it, and for each job capped
    (by id) what it asked and which rule capped it."""
    capped: list[JobRequest] = []
    why: dict[int, str] = {}
    for request in requests:
        ceiling = fairness.ceiling(request.repo)
        if ceiling is None or request.score <= ceiling[0]:
            capped.append(request)
            continue
        value, rule = ceiling
        why[request.job.id] = f"{request.score:.3f} capped to {value:.3f} by {rule}"
        priority = request.priority if request.skip_queue else f"{value:.3f}"
        capped.append(replace(request, score=value, priority=priority))
    return capped, why


def fair_share_order(
    requests: Sequence[JobRequest],
    held: Mapping[str | None, int],
    fairness: Fairness,
) -> list[JobRequest]:
    """The policy's priority order, with repositories taking turns among jobs of equal score.

    Within a run of equal (skip-queue, score), the next job is the first (fewest nodes, then
    oldest) of the repository with the fewest nodes held per unit of share, counting `held`
    (its kept leases) plus the jobs this order already gave it; between repositories that
    hold as much, the one whose next job comes first in the priority order. A run of one
    repository is left as it is.
    """
    ordered = priority_order(requests)
    taken: dict[str | None, float] = {repo: float(nodes) for repo, nodes in held.items()}
    out: list[JobRequest] = []
    start = 0
    while start < len(ordered):
        key = (ordered[start].skip_queue, ordered[start].score)
        end = start
        while end < len(ordered) and (ordered[end].skip_queue, ordered[end].score) == key:
            end += 1
        queues: dict[str | None, deque[tuple[int, JobRequest]]] = {}
        for rank in range(start, end):
            queues.setdefault(ordered[rank].repo, deque()).append((rank, ordered[rank]))
        if len(queues) == 1:
            out.extend(ordered[start:end])
        else:
            while queues:
                repo = min(
                    queues,
                    key=lambda r: (taken.get(r, 0.0) / fairness.share(r), queues[r][0][0]),
                )
                _, request = queues[repo].popleft()
                out.append(request)
                taken[repo] = taken.get(repo, 0.0) + request.nodes
                if not queues[repo]:
                    del queues[repo]
        start = end
    return out


class QuotaBook:
    """The repository and team node quotas as the fleet's `AdmissionGate`: what each holds,
    and whether a job may take more."""

    def __init__(self, fairness: Fairness, held: Mapping[str | None, int]) -> None:
        self.fairness = fairness
        self.held: dict[str | None, int] = defaultdict(int, held)
        self.team_held: dict[str, int] = defaultdict(int)
        for repo, nodes in held.items():
            team = fairness.team(repo)
            if team is not None:
                self.team_held[team] += nodes

    def refuse(self, request: JobRequest, fleet: FleetState) -> Blocked | None:
        """Why the job must wait for its repository's or team's quota; None when it may go."""
        repo, nodes = request.repo, request.nodes
        name = repo or UNKNOWN_REPO
        pool = next((p for p in fleet.candidates(request.requirement) if p is not None), None)
        limits = self.fairness.limits(repo)
        if limits is not None and limits.max_nodes is not None:
            held, quota = self.held[repo], limits.max_nodes
            if held + nodes > quota:
                named = repo if repo is not None and repo in self.fairness.repo_limits else ANY_REPO
                rule = f"repo_limits[{named}]"
                return Blocked(
                    request.job.id,
                    nodes,
                    pool,
                    BlockReason.REPO_QUOTA,
                    _detail(nodes, f"repository {name}", held, quota, f"{rule}.max_nodes"),
                    scope=f"{name} {held}/{quota}",
                )
        team = self.fairness.team(repo)
        if team is not None:
            quota_or_none = self.fairness.teams[team].max_nodes
            if quota_or_none is not None and self.team_held[team] + nodes > quota_or_none:
                held = self.team_held[team]
                return Blocked(
                    request.job.id,
                    nodes,
                    pool,
                    BlockReason.TEAM_QUOTA,
                    _detail(
                        nodes,
                        f"team {team} ({name}'s)",
                        held,
                        quota_or_none,
                        f"teams[{team}].max_nodes",
                    ),
                    scope=f"{team} {held}/{quota_or_none}",
                )
        return None

    def charge(self, request: JobRequest, nodes: int) -> None:
        self.held[request.repo] += nodes
        team = self.fairness.team(request.repo)
        if team is not None:
            self.team_held[team] += nodes


def _detail(nodes: int, who: str, held: int, quota: int, rule: str) -> str:
    if nodes > quota:
        return (
            f"needs {nodes}, more than {who} may hold at all ({quota} nodes, {rule}): it waits "
            "until the quota is raised"
        )
    return f"needs {nodes}, {who} holds {held} of its {quota} nodes ({rule})"
