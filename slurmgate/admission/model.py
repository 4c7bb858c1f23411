"""The admission data model: runners, jobs, leases rebuilt from labels, and planner decisions."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from slurmgate.admission.labels import (
    JOB_PREFIX,
    NODES_PREFIX,
    LabelError,
    LeaseLabel,
    fold,
    is_anchor_label,
    is_lease,
    pool_of,
)


@dataclass(frozen=True, slots=True)
class Runner:
    """One self-hosted runner as GitHub lists it. A runner is one capacity token."""

    id: int
    name: str
    online: bool
    busy: bool
    labels: tuple[str, ...]
    read_only: frozenset[str] = frozenset()

    @property
    def folded(self) -> frozenset[str]:
        return frozenset(fold(label) for label in self.labels)

    @property
    def pools(self) -> list[str]:
        return pool_of(self.labels)

    @property
    def pool(self) -> str | None:
        """The runner's single `cluster:` label; None for legacy and misconfigured runners."""
        pools = self.pools
        return pools[0] if len(pools) == 1 else None

    @property
    def legacy(self) -> bool:
        return not self.pools

    @property
    def misconfigured(self) -> bool:
        return len(self.pools) > 1

    @property
    def lease_labels(self) -> list[str]:
        return sorted(fold(label) for label in self.labels if is_lease(label))

    def managed_job_labels(self) -> list[str]:
        """The per-job labels an anchor carries (`ci-job-*`, `ci-attempt-*`, `nodes:*`)."""
        return sorted(fold(label) for label in self.labels if is_anchor_label(label))


class JobStatus(StrEnum):
    """A job's status as GitHub reports it; UNKNOWN stands for any status GitHub adds later.

    An UNKNOWN job is not active: nothing is admitted for it, and a lease that points at it is
    kept (it is neither finished nor gone, and not known to be still queued either).
    """

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    WAITING = "waiting"
    REQUESTED = "requested"
    PENDING = "pending"
    UNKNOWN = "unknown"


NOT_STARTED = frozenset(
    {JobStatus.QUEUED, JobStatus.WAITING, JobStatus.REQUESTED, JobStatus.PENDING}
)
"""The statuses of a job that GitHub has not dispatched yet."""


@dataclass(frozen=True, slots=True)
class Job:
    """A workflow job as GitHub reports it; `labels` is its runs-on request."""

    id: int
    run_id: int
    run_attempt: int
    name: str
    labels: tuple[str, ...]
    status: JobStatus
    created_at: datetime
    conclusion: str | None = None
    runner_id: int | None = None
    runner_name: str | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None

    @property
    def active(self) -> bool:
        """Queued or running: a lease for it must be kept."""
        return self.status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS)

    def gate_labels(self) -> list[str]:
        """The managed labels of the job's runs-on: what its anchor must receive to dispatch it."""
        return sorted(fold(label) for label in self.labels if is_anchor_label(label))


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease rebuilt from runner labels alone: one `ci-lease-*` label shared by N runners."""

    label: str
    job_id: int
    attempt: int
    created_at: int
    runner_ids: tuple[int, ...]
    pool: str | None
    anchor_id: int | None
    anchor_labels: tuple[str, ...]
    requested_nodes: int | None

    @property
    def lease_id(self) -> str:
        return LeaseLabel.parse(self.label).lease_id

    @property
    def size(self) -> int:
        return len(self.runner_ids)


@dataclass(frozen=True, slots=True)
class MalformedLabel:
    runner_id: int
    label: str
    reason: str


def leases_from_fleet(
    runners: tuple[Runner, ...] | list[Runner],
) -> tuple[list[Lease], list[MalformedLabel]]:
    """Rebuild every lease from one read of the fleet; report lease labels that do not parse.

    The anchor is the leased runner that also carries per-job labels. When several do (a crash
    between steps of two protocols), the lowest runner id is the anchor and the rest are strays
    that the planner cleans.
    """
    members: dict[str, list[Runner]] = defaultdict(list)
    malformed: list[MalformedLabel] = []
    for runner in runners:
        for label in runner.lease_labels:
            try:
                LeaseLabel.parse(label)
            except LabelError as exc:
                malformed.append(MalformedLabel(runner.id, label, str(exc)))
                continue
            members[label].append(runner)
    leases = []
    for label, holders in sorted(members.items()):
        parsed = LeaseLabel.parse(label)
        holders.sort(key=lambda r: r.id)
        anchors = [r for r in holders if r.managed_job_labels()]
        anchor = anchors[0] if anchors else None
        requested = None
        if anchor is not None:
            counts = [
                label[len(NODES_PREFIX) :]
                for label in anchor.managed_job_labels()
                if label.startswith(NODES_PREFIX)
            ]
            if len(counts) == 1 and counts[0].isdigit():
                requested = int(counts[0])
        pools = {r.pool for r in holders}
        leases.append(
            Lease(
                label=label,
                job_id=parsed.job_id,
                attempt=parsed.attempt,
                created_at=parsed.created_at,
                runner_ids=tuple(r.id for r in holders),
                pool=pools.pop() if len(pools) == 1 else None,
                anchor_id=anchor.id if anchor else None,
                anchor_labels=tuple(anchor.managed_job_labels()) if anchor else (),
                requested_nodes=requested,
            )
        )
    return leases, malformed


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the planner reads: one consistent read of runners and jobs.

    `jobs` holds queued and in-progress jobs, plus any job a lease points at (looked up by id,
    so a completed or vanished job is told apart from one the listing missed). `missing_job_ids`
    are lease jobs that GitHub answered 404 for. `unreadable_runners` counts runners GitHub
    listed in a shape that could not be read: any of them may be a lease's anchor or holder.
    `skip_queue_job_ids` are the queued jobs whose `ci-skip-queue-pr-<PR>` label the read
    verified (someone allowed to added the PR's skip-queue label): they outrank every score.
    `unread_repos` are (repository, why) for the repositories of a many-repository scope whose
    jobs GitHub would not list this time (404, or 403 to an App not granted them): their queued
    jobs are not in `jobs`, and their leases' jobs were looked up by id as usual. `job_repos`
    says which repository (OWNER/NAME, folded) each listed job belongs to, for the fairness
    rules (`admission/fairness.py`); a job it lacks belongs to an unknown one.
    """

    runners: tuple[Runner, ...]
    jobs: tuple[Job, ...]
    taken_at: datetime
    missing_job_ids: frozenset[int] = frozenset()
    unreadable_runners: int = 0
    skip_queue_job_ids: frozenset[int] = frozenset()
    unread_repos: tuple[tuple[str, str], ...] = ()
    job_repos: Mapping[int, str] = field(default_factory=dict)


# ---- decisions -------------------------------------------------------------------------------


class ReleaseReason(StrEnum):
    JOB_FINISHED = "job-finished"
    JOB_MISSING = "job-missing"
    NO_ANCHOR = "no-anchor"
    EXPIRED_QUEUED = "expired-while-queued"
    CONFLICT_LOST = "conflict-lost"
    INCOMPLETE = "incomplete"
    CRASHED_RUN = "crashed-run"


class BlockReason(StrEnum):
    NO_CAPACITY = "no-free-capacity"
    NEVER_FITS = "larger-than-any-compatible-pool"
    NO_POOL = "no-compatible-pool"
    BAD_INPUT = "bad-input"
    RESERVED = "held-for-reservation"
    CORDONED = "pool-cordoned"
    REPO_QUOTA = "repo-quota"
    TEAM_QUOTA = "team-quota"


@dataclass(frozen=True, slots=True)
class Admit:
    """Create a lease: label `runner_ids`, verify, then give `anchor_id` the job's own labels."""

    job_id: int
    attempt: int
    pool: str | None
    nodes: int
    runner_ids: tuple[int, ...]
    anchor_id: int
    lease_label: str
    anchor_labels: tuple[str, ...]
    priority: str
    reason: str
    created_at: datetime | None = None  # when GitHub queued the job (the metrics' wait)

    def line(self, verb: str = "admit") -> str:
        """One log line: job id, lease id, pool, size and anchor (and why, for a decision)."""
        why = f" reason={self.reason}" if verb == "admit" else ""
        return (
            f"{verb} job={self.job_id} lease={self.lease_label} pool={self.pool} "
            f"nodes={self.nodes} anchor={self.anchor_id}{why}"
        )


@dataclass(frozen=True, slots=True)
class Release:
    """Remove a lease: exactly `labels` (managed only) from each runner in the mapping.

    `may_dispatch`: the job was not known to have started or ended when the plan was made (it
    was queued, or unknown), so GitHub may dispatch it to `anchor_id` while the labels go;
    `leases.release_lease` then re-reads the job and the anchor first, and removes the
    `dispatch_gate` before anything else.
    """

    lease_label: str
    job_id: int
    pool: str | None
    labels: tuple[tuple[int, tuple[str, ...]], ...]
    reason: ReleaseReason
    detail: str = ""
    anchor_id: int | None = None
    may_dispatch: bool = False

    @property
    def runner_ids(self) -> tuple[int, ...]:
        return tuple(runner_id for runner_id, _ in self.labels)

    @property
    def dispatch_gate(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """The anchor's labels whose removal stops GitHub from dispatching the job there: its
        `ci-job-*` (unique to the job), or every per-job label if it carries none."""
        for runner_id, labels in self.labels:
            if runner_id != self.anchor_id:
                continue
            per_job = tuple(label for label in labels if is_anchor_label(label))
            gate = tuple(label for label in per_job if fold(label).startswith(JOB_PREFIX))
            if gate or per_job:
                return ((runner_id, gate or per_job),)
        return ()

    def after_gate(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """Every label of the release but its dispatch gate, the anchor's last."""
        gate = {(rid, fold(label)) for rid, labels in self.dispatch_gate for label in labels}
        rest: list[tuple[int, tuple[str, ...]]] = []
        for runner_id, labels in sorted(self.labels, key=lambda p: p[0] == self.anchor_id):
            left = tuple(label for label in labels if (runner_id, fold(label)) not in gate)
            if left:
                rest.append((runner_id, left))
        return tuple(rest)

    def line(self) -> str:
        return (
            f"release job={self.job_id} lease={self.lease_label} pool={self.pool} "
            f"reason={self.reason.value} {self.detail}"
        )


@dataclass(frozen=True, slots=True)
class Clean:
    """Remove stray managed labels from one runner that holds no lease for them."""

    runner_id: int
    labels: tuple[str, ...]
    reason: str

    def line(self) -> str:
        return f"clean runner={self.runner_id} labels={','.join(self.labels)} reason={self.reason}"


@dataclass(frozen=True, slots=True)
class Blocked:
    """A queued job that waits, and why."""

    job_id: int
    nodes: int | None
    pool: str | None
    reason: BlockReason
    detail: str
    scope: str = ""  # a quota's holder and use, e.g. "acme/bench 6/8", shown on the board

    def line(self) -> str:
        return (
            f"blocked job={self.job_id} lease=- pool={self.pool} nodes={self.nodes} "
            f"reason={self.reason.value} {self.detail}"
        )


@dataclass(frozen=True, slots=True)
class PoolRow:
    """One line of the pool board."""

    pool: str
    runners: int
    online: int
    leased: int
    busy_unleased: int
    free: int
    admitted_nodes: int
    blocked: int
    slurm: str = ""  # a pool with a partition: usable nodes, and why the others are missing
    cordon: str = ""  # a cordoned pool: "cordoned (why): draining, N leases" or "... drained"
    leases: int = 0  # distinct leases its runners carry
    slurm_usable: int | None = None  # Slurm's view (a pool mapped to a partition that answered)
    slurm_total: int | None = None


@dataclass(frozen=True, slots=True)
class Decisions:
    admit: tuple[Admit, ...] = ()
    release: tuple[Release, ...] = ()
    clean: tuple[Clean, ...] = ()
    blocked: tuple[Blocked, ...] = ()
    misconfigured_runners: tuple[tuple[int, str], ...] = ()
    board: tuple[PoolRow, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def changes(self) -> bool:
        return bool(self.admit or self.release or self.clean)

    def board_rows(self) -> list[dict[str, object]]:
        """The pool board as rows: capacity, leased, free, and the blocked jobs with reasons.

        Blocked jobs whose pool has no board row (no compatible pool) get a row of their own.
        """
        blocked: dict[str, list[str]] = {}
        for b in self.blocked:
            nodes = f"{b.nodes}n" if b.nodes is not None else "?n"
            scope = f" {b.scope}" if b.scope else ""
            blocked.setdefault(b.pool or "(none)", []).append(
                f"job {b.job_id} ({nodes}): {b.reason.value}{scope}"
            )
        rows: list[dict[str, object]] = []
        for row in self.board:
            rows.append(
                {
                    "pool": row.pool,
                    "runners": row.runners,
                    "online": row.online,
                    "leased": row.leased,
                    "busy_unleased": row.busy_unleased,
                    "free": row.free,
                    "admitted_nodes": row.admitted_nodes,
                    "blocked": "; ".join(blocked.pop(row.pool, [])),
                    "slurm": row.slurm,
                    "cordon": row.cordon,
                }
            )
        for pool, jobs in sorted(blocked.items()):
            rows.append(
                {
                    "pool": pool,
                    "runners": 0,
                    "online": 0,
                    "leased": 0,
                    "busy_unleased": 0,
                    "free": 0,
                    "admitted_nodes": 0,
                    "blocked": "; ".join(jobs),
                    "slurm": "",
                    "cordon": "",
                }
            )
        return rows
