"""The emulator's in-memory GitHub: runners, labels, runs, jobs, dispatch, quota and faults.

It also keeps what skip-queue authorization reads: each pull request's label events (who added
or removed which label) and the organization's team memberships.
"""

from __future__ import annotations

import csv
import fnmatch
import hashlib
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from slurmgate.errors import InputError
from slurmgate.github.scope import is_repo
from slurmgate.testbed.emulator.apps import AppRegistry

READ_ONLY = "read-only"
CUSTOM = "custom"
DEFAULT_READ_ONLY = ("self-hosted", "Linux", "X64")
API_DOCS = "https://docs.github.com/rest"

# Called with the action ("queued", "in_progress", "completed") and the job, under the state lock.
JobListener = Callable[[str, "EmuJob"], None]


class EmulatorInputError(InputError):
    """Bad input to the admin API or the fleet builder; the message names the field."""


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fold(label: str) -> str:
    return label.casefold()


@dataclass
class EmuRunner:
    id: int
    name: str
    status: str = "online"
    busy: bool = False
    os: str = "Linux"
    labels: list[tuple[str, str]] = field(default_factory=list)  # (name, type)
    runner_group_id: int = 1

    def folded(self) -> set[str]:
        return {fold(name) for name, _ in self.labels}


@dataclass
class EmuJob:
    id: int
    run_id: int
    run_attempt: int
    name: str
    labels: list[str]
    duration_s: float
    created_at: float
    status: str = "queued"
    conclusion: str | None = None
    runner_id: int | None = None
    runner_name: str | None = None
    started_at: float | None = None
    completed_at: float | None = None


@dataclass
class EmuRun:
    id: int
    name: str
    run_attempt: int
    created_at: float
    updated_at: float
    run_number: int
    pull_requests: list[int] = field(default_factory=list)
    repo: str = ""  # OWNER/NAME; empty is the emulator's first repository


@dataclass
class EmuIssueEvent:
    """One `labeled` or `unlabeled` event of a pull request (GitHub keeps them per issue)."""

    id: int
    event: str
    label: str
    actor: str
    created_at: float


TEAM_STATES = ("active", "pending")


@dataclass
class Fault:
    """One injected fault. `remaining` None means until cleared."""

    id: int
    kind: str
    method: str = "*"
    path: str = "*"
    remaining: int | None = 1
    status: int = 500
    retry_after_s: float | None = 1.0
    latency_ms: float = 0.0
    nth_write: int = 0  # absolute write sequence number this fault fires on
    hang_s: float = 0.0
    applied: bool = True

    def matches(self, method: str, path: str) -> bool:
        return (
            self.method == "*" or self.method.upper() == method.upper()
        ) and fnmatch.fnmatchcase(path, self.path)


FAULT_KINDS = ("status", "rate_limit", "latency", "fail_nth_write", "hang_nth_write")
FAULT_FIELDS = frozenset(
    {"kind", "method", "path", "count", "status", "retry_after_s", "ms", "hang_s", "applied", "n"}
)

# The random faults a fault plan draws from, and what each answers:
#   server-error      500, 502 or 503 (nothing applied);
#   rate-limit        429 with Retry-After (nothing applied);
#   secondary-limit   403 "secondary rate limit" with Retry-After (nothing applied);
#   timeout           the request is applied, then the answer waits past the client's timeout;
#   lost-answer       a write is applied, then answered 502 (a read gets a plain 502).
PLAN_FAULT_KINDS = ("server-error", "rate-limit", "secondary-limit", "timeout", "lost-answer")


@dataclass
class FaultPlan:
    """Random faults on a `rate` share of GitHub requests, drawn from a seeded generator.

    `kinds` weighs the kinds of PLAN_FAULT_KINDS (missing ones are never drawn); `retry_after_s`
    is the Retry-After of the rate limits (compressed: GitHub says 60) and `delay_s` how long a
    `timeout` answer waits (set it beyond the client's timeout). The admin API is never faulted.
    """

    rate: float = 0.0
    seed: int = 0
    kinds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PLAN_FAULT_KINDS, 1.0))
    retry_after_s: float = 1.0
    delay_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise EmulatorInputError(f"fault rate {self.rate} is not between 0 and 1")
        unknown = sorted(set(self.kinds) - set(PLAN_FAULT_KINDS))
        if unknown:
            raise EmulatorInputError(
                f"fault kinds {', '.join(unknown)} unknown; use {', '.join(PLAN_FAULT_KINDS)}"
            )
        if any(weight < 0 for weight in self.kinds.values()):
            raise EmulatorInputError("fault kind weights must be 0 or more")
        if self.retry_after_s < 0 or self.delay_s < 0:
            raise EmulatorInputError("retry_after_s and delay_s must be 0 or more")

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> FaultPlan:
        """A plan from the admin API's JSON; the error names the field."""
        try:
            kinds = spec.get("kinds")
            return cls(
                rate=float(spec.get("rate", 0.0)),
                seed=int(spec.get("seed", 0)),
                kinds=(
                    dict.fromkeys(PLAN_FAULT_KINDS, 1.0)
                    if kinds is None
                    else {str(k): float(v) for k, v in dict(kinds).items()}
                ),
                retry_after_s=float(spec.get("retry_after_s", 1.0)),
                delay_s=float(spec.get("delay_s", 2.0)),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, EmulatorInputError):
                raise
            raise EmulatorInputError(
                "fault plan: rate, retry_after_s and delay_s must be numbers, seed an integer "
                "and kinds an object of kind -> weight"
            ) from None

    def describe(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "seed": self.seed,
            "kinds": dict(self.kinds),
            "retry_after_s": self.retry_after_s,
            "delay_s": self.delay_s,
        }


class EmulatorState:
    """All emulator state behind one lock, so the server thread and test threads can share it."""

    def __init__(
        self,
        repo: str = "acme/gpu-ci",
        *,
        token: str | None = None,
        quota_limit: int = 5000,
        quota_window_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        webhook_urls: list[str] | None = None,
        webhook_secret: str | None = None,
        fault_plan: FaultPlan | None = None,
        repos: list[str] | tuple[str, ...] = (),
    ) -> None:
        if not is_repo(repo):
            raise EmulatorInputError(f"repo {repo!r} is not OWNER/NAME; write it like acme/gpu-ci")
        self.owner, self.repo_name = repo.split("/")
        # more repositories of the same owner: runs and jobs live in one of them
        self.repo_names: list[str] = [repo]
        for extra in repos:
            if not is_repo(extra) or extra.split("/")[0].casefold() != self.owner.casefold():
                raise EmulatorInputError(
                    f"repos entry {extra!r} is not {self.owner}/NAME; every repository of the "
                    "emulator has the same owner"
                )
            if extra.casefold() not in {name.casefold() for name in self.repo_names}:
                self.repo_names.append(extra)
        self.token = token
        self.clock = clock
        self.apps = AppRegistry(clock)  # GitHub Apps, installations, installation tokens
        self.lock = threading.RLock()
        self.runners: dict[int, EmuRunner] = {}
        self.jobs: dict[int, EmuJob] = {}
        self.runs: dict[int, EmuRun] = {}
        self._label_ids: dict[str, int] = {}
        self._next_runner = 1
        self._next_run = 1001
        self._next_job = 50001
        self._next_fault = 1
        self.faults: list[Fault] = []
        self.write_seq = 0
        self.fault_plan = FaultPlan()
        self._fault_rng = random.Random(0)
        self.faults_injected: Counter[str] = Counter()
        if fault_plan is not None:
            self.set_fault_plan(fault_plan)
        # quota
        self.quota_limit = quota_limit
        self.quota_window_s = quota_window_s
        self.quota_used = 0
        self.quota_reset_at = clock() + quota_window_s
        # counters
        self.requests: Counter[str] = Counter()
        self.not_modified: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.writes = 0
        self.quota_used_total = 0
        # webhook seam: every job change calls `job_changed`, which calls listeners
        self.webhook_urls: list[str] = list(webhook_urls or [])
        self.webhook_secret = webhook_secret
        self.listeners: list[JobListener] = []
        self.job_events: list[tuple[str, int]] = []
        self._user_json: dict[str, Any] | None = None
        self._repository_json: dict[str, dict[str, Any]] = {}
        self._queued: set[int] = set()
        self._running: set[int] = set()
        # skip-queue authorization: label events per PR number, members per team slug
        self.issue_events: dict[int, list[EmuIssueEvent]] = {}
        self.team_members: dict[str, dict[str, str]] = {}  # folded slug -> folded login -> state
        self._next_event = 9000001

    @property
    def repo(self) -> str:
        return f"{self.owner}/{self.repo_name}"

    def known_repo(self, full_name: str) -> str | None:
        """The emulator's spelling of repository `full_name` (case-insensitive), or None."""
        wanted = full_name.casefold()
        return next((name for name in self.repo_names if name.casefold() == wanted), None)

    def run_repo(self, run: EmuRun) -> str:
        return run.repo or self.repo

    # ---- fleet ----

    def label_id(self, name: str) -> int:
        return self._label_ids.setdefault(fold(name), len(self._label_ids) + 1)

    def add_runner(
        self,
        name: str,
        labels: list[str] | tuple[str, ...] = (),
        *,
        status: str = "online",
        read_only: tuple[str, ...] = DEFAULT_READ_ONLY,
        busy: bool = False,
    ) -> EmuRunner:
        if not name or not isinstance(name, str):
            raise EmulatorInputError("runner name is empty; give each runner a name")
        if status not in ("online", "offline"):
            raise EmulatorInputError(f"runner status {status!r} is not 'online' or 'offline'")
        with self.lock:
            runner = EmuRunner(id=self._next_runner, name=name, status=status, busy=busy)
            self._next_runner += 1
            for label in read_only:
                self._put_label(runner, label, READ_ONLY)
            for label in labels:
                self._put_label(runner, label, CUSTOM)
            self.runners[runner.id] = runner
            self.dispatch()
            return runner

    def _put_label(self, runner: EmuRunner, name: str, kind: str) -> None:
        if fold(name) not in runner.folded():
            self.label_id(name)
            runner.labels.append((name, kind))

    def add_pool(self, name: str, count: int) -> list[EmuRunner]:
        """COUNT online idle runners `<name>-NN` labelled read-only defaults + `cluster:<name>`."""
        if count < 0:
            raise EmulatorInputError(f"pool {name!r} count {count} is negative; use 0 or more")
        width = max(2, len(str(count)))
        return [
            self.add_runner(f"{name}-{i:0{width}d}", [f"cluster:{name}"])
            for i in range(1, count + 1)
        ]

    def add_legacy(self, count: int) -> list[EmuRunner]:
        """COUNT online idle runners with only the read-only defaults (no cluster label)."""
        width = max(2, len(str(count)))
        return [self.add_runner(f"legacy-{i:0{width}d}") for i in range(1, count + 1)]

    def set_runner_status(self, runner_id: int, status: str) -> EmuRunner:
        if status not in ("online", "offline"):
            raise EmulatorInputError(f"status {status!r} is not 'online' or 'offline'")
        with self.lock:
            runner = self.runners.get(runner_id)
            if runner is None:
                raise KeyError(runner_id)
            runner.status = status
            self.dispatch()
            return runner

    # ---- labels (GitHub semantics; callers turn errors into 404/422) ----

    def add_labels(self, runner: EmuRunner, labels: list[str]) -> None:
        with self.lock:
            for label in labels:
                self._put_label(runner, label, CUSTOM)
            self.dispatch()

    def set_labels(self, runner: EmuRunner, labels: list[str]) -> None:
        with self.lock:
            runner.labels = [(n, k) for n, k in runner.labels if k == READ_ONLY]
            for label in labels:
                self._put_label(runner, label, CUSTOM)
            self.dispatch()

    def remove_all_labels(self, runner: EmuRunner) -> None:
        with self.lock:
            runner.labels = [(n, k) for n, k in runner.labels if k == READ_ONLY]
            self.dispatch()

    def remove_label(self, runner: EmuRunner, name: str) -> str:
        """'removed', 'absent' (GitHub: 404) or 'read-only' (emulator: 422)."""
        with self.lock:
            for label, kind in runner.labels:
                if fold(label) == fold(name):
                    if kind == READ_ONLY:
                        return "read-only"
                    runner.labels.remove((label, kind))
                    self.dispatch()
                    return "removed"
            return "absent"

    # ---- jobs and dispatch ----

    def add_job(
        self,
        labels: list[str],
        duration_s: float = 5.0,
        *,
        name: str | None = None,
        run_id: int | None = None,
        pull_request: int | None = None,
        repo: str | None = None,
    ) -> EmuJob:
        """Queue a job in run `run_id` (a new run if absent); `pull_request` makes a new run one
        for that PR number, as a `pull_request` event's run is; `repo` puts a new run in
        another of the emulator's repositories."""
        home = self.repo if repo is None else self.known_repo(repo)
        if home is None:
            raise EmulatorInputError(
                f"repo {repo!r} is not one of the emulator's repositories; add it with repos=[...]"
            )
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise EmulatorInputError("labels must be a list of non-empty strings (the runs-on)")
        if not labels:
            raise EmulatorInputError("labels is empty; give the job its runs-on labels")
        if duration_s < 0:
            raise EmulatorInputError(f"duration_s {duration_s} is negative; use 0 or more")
        with self.lock:
            now = self.clock()
            if run_id is None:
                run_id = self._next_run
            run = self.runs.get(run_id)
            if run is None:
                run = EmuRun(run_id, f"workflow-{run_id}", 1, now, now, len(self.runs) + 1)
                run.repo = "" if home == self.repo else home
                if pull_request is not None:
                    self._check_issue_number(pull_request)
                    run.pull_requests.append(pull_request)
                    self.issue_events.setdefault(pull_request, [])
                self.runs[run_id] = run
                self._next_run = max(self._next_run, run_id + 1)
            job = EmuJob(
                id=self._next_job,
                run_id=run.id,
                run_attempt=run.run_attempt,
                name=name or f"job-{self._next_job}",
                labels=list(labels),
                duration_s=float(duration_s),
                created_at=now,
            )
            self._next_job += 1
            self.jobs[job.id] = job
            run.updated_at = now
            self.job_changed("queued", job)
            self.dispatch()
            return job

    def rerun(self, run_id: int) -> list[EmuJob]:
        """Re-run a completed run: a new attempt with a fresh copy of every job of the last one."""
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                raise KeyError(run_id)
            if self.run_status(run)[0] != "completed":
                raise EmulatorInputError(
                    f"run {run_id} is not completed; complete or cancel its jobs before a re-run"
                )
            previous = [
                job
                for job in self.jobs.values()
                if job.run_id == run_id and job.run_attempt == run.run_attempt
            ]
            run.run_attempt += 1
            now = self.clock()
            run.updated_at = now
            fresh = []
            for old in sorted(previous, key=lambda j: j.id):
                job = EmuJob(
                    id=self._next_job,
                    run_id=run_id,
                    run_attempt=run.run_attempt,
                    name=old.name,
                    labels=list(old.labels),
                    duration_s=old.duration_s,
                    created_at=now,
                )
                self._next_job += 1
                self.jobs[job.id] = job
                fresh.append(job)
                self.job_changed("queued", job)
            self.dispatch()
            return fresh

    def finish_job(self, job_id: int, conclusion: str) -> EmuJob:
        with self.lock:
            job = self.jobs.get(job_id)
            if job is None:
                raise KeyError(job_id)
            if job.status != "completed":
                self._complete(job, conclusion)
                self.dispatch()
            return job

    def _complete(self, job: EmuJob, conclusion: str) -> None:
        now = self.clock()
        job.status = "completed"
        job.conclusion = conclusion
        job.completed_at = now
        if job.started_at is None:
            job.started_at = now
        runner = self.runners.get(job.runner_id) if job.runner_id is not None else None
        if runner is not None:
            runner.busy = False
        self.runs[job.run_id].updated_at = now
        self.job_changed("completed", job)

    def dispatch(self) -> int:
        """Assign queued jobs (oldest first) to idle online runners carrying all their labels.

        Among the runners that match, the lowest id wins, so dispatch is deterministic.
        """
        assigned = 0
        with self.lock:
            if not self._queued:
                return 0
            idle: dict[str, set[int]] = {}  # folded label -> idle online runner ids
            for runner in self.runners.values():
                if runner.status == "online" and not runner.busy:
                    for label in runner.folded():
                        idle.setdefault(label, set()).add(runner.id)
            if not idle:
                return 0
            now = self.clock()
            for job_id in sorted(self._queued):
                job = self.jobs[job_id]
                pools = sorted((idle.get(fold(label), set()) for label in job.labels), key=len)
                if not pools or not pools[0]:
                    continue
                matching = set.intersection(*pools)
                if not matching:
                    continue
                runner = self.runners[min(matching)]
                for label in runner.folded():
                    idle[label].discard(runner.id)
                runner.busy = True
                job.status = "in_progress"
                job.runner_id = runner.id
                job.runner_name = runner.name
                job.started_at = now
                self.runs[job.run_id].updated_at = now
                self.job_changed("in_progress", job)
                assigned += 1
        return assigned

    def tick(self) -> None:
        """Complete jobs whose duration has passed, then dispatch."""
        with self.lock:
            now = self.clock()
            for job_id in sorted(self._running):
                job = self.jobs[job_id]
                if job.started_at is not None and now >= job.started_at + job.duration_s:
                    self._complete(job, "success")
            self.dispatch()

    def job_changed(self, action: str, job: EmuJob) -> None:
        """The one seam every job state change passes through (webhooks hang off it)."""
        self.job_events.append((action, job.id))
        if action == "queued":
            self._queued.add(job.id)
        else:
            self._queued.discard(job.id)
        if action == "in_progress":
            self._running.add(job.id)
        else:
            self._running.discard(job.id)
        for listener in list(self.listeners):
            listener(action, job)

    def webhook_payload(self, action: str, job: EmuJob) -> dict[str, Any]:
        return {
            "action": action,
            "workflow_job": self.job_json(job),
            "repository": self.repository_json(self.run_repo(self.runs[job.run_id])),
            "sender": self.user_json(),
        }

    def run_status(self, run: EmuRun) -> tuple[str, str | None]:
        statuses = [
            j for j in self.jobs.values() if j.run_id == run.id and j.run_attempt == run.run_attempt
        ]
        if not statuses or all(j.status == "queued" for j in statuses):
            return "queued", None
        if all(j.status == "completed" for j in statuses):
            conclusions = {j.conclusion for j in statuses}
            for worst in ("failure", "cancelled"):
                if worst in conclusions:
                    return "completed", worst
            return "completed", "success"
        return "in_progress", None

    # ---- pull-request labels and teams (what skip-queue authorization reads) ----

    @staticmethod
    def _check_issue_number(number: int) -> None:
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number < 2**31:
            raise EmulatorInputError(f"pull request number {number!r} must be 1 or more")

    def label_issue(self, number: int, label: str, actor: str) -> EmuIssueEvent:
        """`actor` adds `label` to pull request `number`: one `labeled` event."""
        return self._label_event(number, "labeled", label, actor)

    def unlabel_issue(self, number: int, label: str, actor: str) -> EmuIssueEvent:
        """`actor` removes `label` from pull request `number`: one `unlabeled` event."""
        return self._label_event(number, "unlabeled", label, actor)

    def _label_event(self, number: int, event: str, label: str, actor: str) -> EmuIssueEvent:
        self._check_issue_number(number)
        if not isinstance(label, str) or not label.strip():
            raise EmulatorInputError("label must be a non-empty string")
        if not isinstance(actor, str) or not actor.strip():
            raise EmulatorInputError("actor must be a non-empty login")
        with self.lock:
            record = EmuIssueEvent(self._next_event, event, label, actor, self.clock())
            self._next_event += 1
            self.issue_events.setdefault(number, []).append(record)
            return record

    def set_team_member(self, team_slug: str, login: str, state: str | None) -> None:
        """Make `login` a member of the organization's team in `state` (active or pending), or
        no member at all with None. The team exists once it has had a member."""
        if state is not None and state not in TEAM_STATES:
            raise EmulatorInputError(f"state {state!r} is not one of {', '.join(TEAM_STATES)}")
        if not team_slug or not login:
            raise EmulatorInputError("team_slug and login must be non-empty")
        with self.lock:
            members = self.team_members.setdefault(fold(team_slug), {})
            if state is None:
                members.pop(fold(login), None)
            else:
                members[fold(login)] = state

    def team_membership(self, team_slug: str, login: str) -> str | None:
        """The member's state, or None when the team or the membership does not exist."""
        with self.lock:
            return self.team_members.get(fold(team_slug), {}).get(fold(login))

    # ---- quota ----

    def quota_headers(self) -> dict[str, str]:
        with self.lock:
            self._roll_quota()
            return {
                "x-ratelimit-limit": str(self.quota_limit),
                "x-ratelimit-remaining": str(max(0, self.quota_limit - self.quota_used)),
                "x-ratelimit-used": str(self.quota_used),
                "x-ratelimit-reset": str(math.ceil(self.quota_reset_at)),
                "x-ratelimit-resource": "core",
            }

    def _roll_quota(self) -> None:
        now = self.clock()
        if now >= self.quota_reset_at:
            self.quota_used = 0
            self.quota_reset_at = now + self.quota_window_s

    def quota_exhausted(self) -> bool:
        with self.lock:
            self._roll_quota()
            return self.quota_used >= self.quota_limit

    def consume_quota(self) -> None:
        with self.lock:
            self._roll_quota()
            self.quota_used += 1
            self.quota_used_total += 1

    def set_quota(self, limit: int | None = None, window_s: float | None = None) -> None:
        with self.lock:
            if limit is not None:
                if limit < 0:
                    raise EmulatorInputError(f"limit {limit} is negative; use 0 or more")
                self.quota_limit = limit
            if window_s is not None:
                if window_s <= 0:
                    raise EmulatorInputError(f"window_s {window_s} must be above 0")
                self.quota_window_s = window_s
            self.quota_used = 0
            self.quota_reset_at = self.clock() + self.quota_window_s

    # ---- faults ----

    def add_fault(self, spec: dict[str, Any]) -> Fault:
        kind = spec.get("kind")
        if kind not in FAULT_KINDS:
            raise EmulatorInputError(f"kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
        unknown = sorted(str(key) for key in spec if key not in FAULT_FIELDS)
        if unknown:  # a misspelt field would silently give a fault of other shape
            raise EmulatorInputError(
                f"fault field {unknown[0]!r} is unknown; use {', '.join(sorted(FAULT_FIELDS))}"
            )
        with self.lock:
            fault = Fault(id=self._next_fault, kind=str(kind))
            self._next_fault += 1
            try:
                fault.method = str(spec.get("method", "*"))
                fault.path = str(spec.get("path", "*"))
                count = spec.get("count", 1 if kind != "latency" else None)
                fault.remaining = None if count is None else int(count)
                default_status = {"rate_limit": 429, "hang_nth_write": 504}.get(str(kind), 500)
                fault.status = int(spec.get("status", default_status))
                retry_after = spec.get("retry_after_s", 1.0)
                fault.retry_after_s = None if retry_after is None else float(retry_after)
                fault.latency_ms = float(spec.get("ms", 0.0))
                fault.hang_s = float(spec.get("hang_s", 30.0))
                fault.applied = bool(spec.get("applied", True))
                if kind in ("fail_nth_write", "hang_nth_write"):
                    n = int(spec.get("n", 1))
                    if n < 1:
                        raise EmulatorInputError(f"n {n} must be 1 or more (1 = the next write)")
                    fault.nth_write = self.write_seq + n
                    fault.remaining = 1
            except (TypeError, ValueError) as exc:
                if isinstance(exc, EmulatorInputError):
                    raise
                raise EmulatorInputError(f"fault field has the wrong type: {exc}") from None
            self.faults.append(fault)
            return fault

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def take_fault(self, kind: str, method: str, path: str) -> Fault | None:
        """The first live fault of `kind` matching this request; consumes one use."""
        with self.lock:
            for fault in self.faults:
                if fault.kind == kind and fault.matches(method, path):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self.faults.remove(fault)
                    return fault
            return None

    def set_fault_plan(self, plan: FaultPlan) -> None:
        """Draw random faults by `plan` from now on (rate 0 stops them); counts start at zero."""
        with self.lock:
            self.fault_plan = plan
            self._fault_rng = random.Random(plan.seed)
            self.faults_injected.clear()

    def draw_fault(self) -> str | None:
        """The fault plan's kind for the next GitHub request, or None (most requests)."""
        with self.lock:
            plan = self.fault_plan
            if plan.rate <= 0 or self._fault_rng.random() >= plan.rate:
                return None
            kinds = [kind for kind in PLAN_FAULT_KINDS if plan.kinds.get(kind, 0.0) > 0]
            if not kinds:
                return None
            kind = self._fault_rng.choices(kinds, [plan.kinds[k] for k in kinds])[0]
            self.faults_injected[kind] += 1
            return kind

    def server_error_status(self) -> int:
        with self.lock:
            return self._fault_rng.choice((500, 502, 503))

    def next_write(self) -> tuple[int, Fault | None]:
        """Number this mutating request; return the nth-write fault that fires on it, if any."""
        with self.lock:
            self.write_seq += 1
            self.writes += 1
            for fault in self.faults:
                if fault.kind in ("fail_nth_write", "hang_nth_write") and (
                    fault.nth_write == self.write_seq
                ):
                    self.faults.remove(fault)
                    return self.write_seq, fault
            return self.write_seq, None

    # ---- stats ----

    def stats(self) -> dict[str, Any]:
        """Request counters. `requests` is by "METHOD /path/{template}"; `not_modified` counts
        304s; `writes` counts mutating requests that got past auth, injected status/429 faults
        and the quota check (fail_nth_write victims included); `quota_used` is primary quota."""
        with self.lock:
            return {
                "requests": dict(sorted(self.requests.items())),
                "total": sum(self.requests.values()),
                "not_modified": sum(self.not_modified.values()),
                "not_modified_by_endpoint": dict(sorted(self.not_modified.items())),
                "writes": self.writes,
                "quota_used": self.quota_used_total,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "faults_injected": dict(sorted(self.faults_injected.items())),
            }

    def reset_stats(self) -> None:
        with self.lock:
            self.requests.clear()
            self.not_modified.clear()
            self.statuses.clear()
            self.writes = 0
            self.quota_used_total = 0
            self.faults_injected.clear()

    # ---- JSON shapes (GitHub's) ----

    def label_json(self, name: str, kind: str) -> dict[str, Any]:
        return {"id": self.label_id(name), "name": name, "type": kind}

    def labels_json(self, runner: EmuRunner, only_read_only: bool = False) -> dict[str, Any]:
        labels = [
            self.label_json(n, k) for n, k in runner.labels if not only_read_only or k == READ_ONLY
        ]
        return {"total_count": len(labels), "labels": labels}

    def runner_json(self, runner: EmuRunner) -> dict[str, Any]:
        return {
            "id": runner.id,
            "name": runner.name,
            "os": runner.os,
            "status": runner.status,
            "busy": runner.busy,
            "ephemeral": False,
            "runner_group_id": runner.runner_group_id,
            "labels": [self.label_json(n, k) for n, k in runner.labels],
        }

    def _api(self, suffix: str, repo: str | None = None) -> str:
        return f"https://api.github.com/repos/{repo or self.repo}{suffix}"

    def job_json(self, job: EmuJob) -> dict[str, Any]:
        run = self.runs[job.run_id]
        sha = hashlib.sha1(f"{run.id}".encode()).hexdigest()
        home = self.run_repo(run)
        return {
            "id": job.id,
            "run_id": job.run_id,
            "run_url": self._api(f"/actions/runs/{job.run_id}", home),
            "run_attempt": job.run_attempt,
            "node_id": f"CR_{job.id}",
            "head_sha": sha,
            "url": self._api(f"/actions/jobs/{job.id}", home),
            "html_url": f"https://github.com/{home}/actions/runs/{job.run_id}/job/{job.id}",
            "status": job.status,
            "conclusion": job.conclusion,
            "created_at": _iso(job.created_at),
            # GitHub reports started_at even for a queued job (its creation time).
            "started_at": _iso(job.started_at if job.started_at is not None else job.created_at),
            "completed_at": _iso(job.completed_at),
            "name": job.name,
            "steps": [],
            "check_run_url": self._api(f"/check-runs/{job.id}", home),
            "labels": list(job.labels),
            "runner_id": job.runner_id,
            "runner_name": job.runner_name,
            "runner_group_id": 1 if job.runner_id is not None else None,
            "runner_group_name": "Default" if job.runner_id is not None else None,
            "workflow_name": run.name,
            "head_branch": "main",
        }

    def user_json(self) -> dict[str, Any]:
        if self._user_json is None:
            self._user_json = self.simple_user_json(self.owner, user_id=1, kind="Organization")
        return self._user_json

    def repository_json(self, repo: str | None = None) -> dict[str, Any]:
        name = repo or self.repo
        if name not in self._repository_json:
            self._repository_json[name] = self._build_repository_json(name)
        return self._repository_json[name]

    @staticmethod
    def simple_user_json(
        login: str, *, user_id: int | None = None, kind: str = "User"
    ) -> dict[str, Any]:
        """GitHub's `simple-user`; a user's id is derived from the login, so it is stable."""
        if user_id is None:
            user_id = int(hashlib.sha256(fold(login).encode()).hexdigest()[:8], 16) + 2
        base = f"https://api.github.com/users/{login}"
        return {
            "login": login,
            "id": user_id,
            "node_id": f"U_{user_id}",
            "avatar_url": f"https://avatars.githubusercontent.com/u/{user_id}",
            "gravatar_id": "",
            "url": base,
            "html_url": f"https://github.com/{login}",
            "followers_url": f"{base}/followers",
            "following_url": f"{base}/following{{/other_user}}",
            "gists_url": f"{base}/gists{{/gist_id}}",
            "starred_url": f"{base}/starred{{/owner}}{{/repo}}",
            "subscriptions_url": f"{base}/subscriptions",
            "organizations_url": f"{base}/orgs",
            "repos_url": f"{base}/repos",
            "events_url": f"{base}/events{{/privacy}}",
            "received_events_url": f"{base}/received_events",
            "type": kind,
            "site_admin": False,
        }

    def issue_event_json(self, number: int, record: EmuIssueEvent) -> dict[str, Any]:
        """A `labeled-issue-event` or `unlabeled-issue-event`, as the issue-events listing has."""
        return {
            "id": record.id,
            "node_id": f"LE_{record.id}",
            "url": self._api(f"/issues/events/{record.id}"),
            "actor": self.simple_user_json(record.actor),
            "event": record.event,
            "commit_id": None,
            "commit_url": None,
            "created_at": _iso(record.created_at),
            "performed_via_github_app": None,
            "label": {"name": record.label, "color": "ededed"},
        }

    def team_membership_json(self, team_slug: str, login: str, state: str) -> dict[str, Any]:
        return {
            "url": f"https://api.github.com/organizations/1/team/1/memberships/{login}",
            "role": "member",
            "state": state,
        }

    def pull_request_json(self, number: int) -> dict[str, Any]:
        """GitHub's `pull-request-minimal`, as a workflow run's `pull_requests` lists it."""
        repo = {
            "id": 1296269,
            "url": f"https://api.github.com/repos/{self.repo}",
            "name": self.repo_name,
        }
        sha = hashlib.sha1(f"pr-{number}".encode()).hexdigest()
        return {
            "id": 7000000 + number,
            "number": number,
            "url": self._api(f"/pulls/{number}"),
            "head": {"ref": f"pr-{number}", "sha": sha, "repo": repo},
            "base": {"ref": "main", "sha": sha, "repo": repo},
        }

    def _build_repository_json(self, repo: str) -> dict[str, Any]:
        api = f"https://api.github.com/repos/{repo}"
        # the first repository keeps GitHub's example id; the others get stable ids of their own
        repo_id = 1296269 + self.repo_names.index(repo) if repo in self.repo_names else 1296269
        urls = {
            f"{key}_url": f"{api}/{suffix}"
            for key, suffix in {
                "archive": "{archive_format}{/ref}",
                "assignees": "assignees{/user}",
                "blobs": "git/blobs{/sha}",
                "branches": "branches{/branch}",
                "collaborators": "collaborators{/collaborator}",
                "comments": "comments{/number}",
                "commits": "commits{/sha}",
                "compare": "compare/{base}...{head}",
                "contents": "contents/{+path}",
                "contributors": "contributors",
                "deployments": "deployments",
                "downloads": "downloads",
                "events": "events",
                "forks": "forks",
                "git_commits": "git/commits{/sha}",
                "git_refs": "git/refs{/sha}",
                "git_tags": "git/tags{/sha}",
                "hooks": "hooks",
                "issue_comment": "issues/comments{/number}",
                "issue_events": "issues/events{/number}",
                "issues": "issues{/number}",
                "keys": "keys{/key_id}",
                "labels": "labels{/name}",
                "languages": "languages",
                "merges": "merges",
                "milestones": "milestones{/number}",
                "notifications": "notifications{?since,all,participating}",
                "pulls": "pulls{/number}",
                "releases": "releases{/id}",
                "stargazers": "stargazers",
                "statuses": "statuses/{sha}",
                "subscribers": "subscribers",
                "subscription": "subscription",
                "tags": "tags",
                "teams": "teams",
                "trees": "git/trees{/sha}",
            }.items()
        }
        return {
            "id": repo_id,
            "node_id": f"R_{repo_id}",
            "name": repo.split("/")[1],
            "full_name": repo,
            "owner": self.user_json(),
            "private": True,
            "html_url": f"https://github.com/{repo}",
            "description": "slurmgate emulator repository",
            "fork": False,
            "url": api,
            **urls,
        }

    def run_json(self, run: EmuRun) -> dict[str, Any]:
        status, conclusion = self.run_status(run)
        sha = hashlib.sha1(f"{run.id}".encode()).hexdigest()
        home = self.run_repo(run)
        repo = self.repository_json(home)
        return {
            "id": run.id,
            "name": run.name,
            "node_id": f"WFR_{run.id}",
            "check_suite_id": run.id,
            "check_suite_node_id": f"CS_{run.id}",
            "head_branch": "main",
            "head_sha": sha,
            "path": ".github/workflows/gpu.yml",
            "display_title": run.name,
            "run_number": run.run_number,
            "run_attempt": run.run_attempt,
            "event": "pull_request" if run.pull_requests else "push",
            "status": status,
            "conclusion": conclusion,
            "workflow_id": 1,
            "url": self._api(f"/actions/runs/{run.id}", home),
            "html_url": f"https://github.com/{home}/actions/runs/{run.id}",
            "pull_requests": [self.pull_request_json(n) for n in run.pull_requests],
            "created_at": _iso(run.created_at),
            "updated_at": _iso(run.updated_at),
            "run_started_at": _iso(run.created_at),
            "actor": self.user_json(),
            "triggering_actor": self.user_json(),
            "jobs_url": self._api(f"/actions/runs/{run.id}/jobs", home),
            "logs_url": self._api(f"/actions/runs/{run.id}/logs", home),
            "check_suite_url": self._api(f"/check-suites/{run.id}", home),
            "artifacts_url": self._api(f"/actions/runs/{run.id}/artifacts", home),
            "cancel_url": self._api(f"/actions/runs/{run.id}/cancel", home),
            "rerun_url": self._api(f"/actions/runs/{run.id}/rerun", home),
            "previous_attempt_url": None,
            "workflow_url": self._api("/actions/workflows/1", home),
            "head_commit": {
                "id": sha,
                "tree_id": sha,
                "message": run.name,
                "timestamp": _iso(run.created_at),
                "author": {"name": "CI", "email": "ci@example.com"},
                "committer": {"name": "CI", "email": "ci@example.com"},
            },
            "repository": repo,
            "head_repository": repo,
        }

    def dump(self) -> dict[str, Any]:
        with self.lock:
            return {
                "repo": self.repo,
                "runners": [self.runner_json(r) for r in sorted(self.runners.values(), key=_id)],
                "jobs": [self.job_json(j) for j in sorted(self.jobs.values(), key=_id)],
                "runs": [
                    {"id": r.id, "status": self.run_status(r)[0]}
                    for r in sorted(self.runs.values(), key=_id)
                ],
                "quota": {
                    "limit": self.quota_limit,
                    "used": self.quota_used,
                    "reset": int(self.quota_reset_at),
                },
                "faults": [f.__dict__ for f in self.faults],
                "fault_plan": {
                    **self.fault_plan.describe(),
                    "injected": dict(sorted(self.faults_injected.items())),
                },
            }


def _id(obj: EmuRunner | EmuJob | EmuRun) -> int:
    return obj.id


def parse_pool(spec: str) -> tuple[str, int]:
    """`cluster:NAME=COUNT` (or `NAME=COUNT`) -> (NAME, COUNT); the error names the fix."""
    raw = spec.strip()
    name, sep, count = raw.partition("=")
    name = name.strip()
    if name.lower().startswith("cluster:"):
        name = name[len("cluster:") :]
    if not sep or not name or not count.strip().isdigit():
        raise EmulatorInputError(
            f"--pool {spec!r} is not cluster:NAME=COUNT; write it like --pool cluster:h100=8"
        )
    return name, int(count)


def build_state(
    repo: str,
    pools: dict[str, int],
    legacy: int = 0,
    token: str | None = None,
    **kwargs: Any,
) -> EmulatorState:
    """A state with one pool of runners per entry (`NAME -> COUNT`) plus `legacy` plain runners."""
    if legacy < 0:
        raise EmulatorInputError(f"legacy {legacy} is negative; use 0 or more")
    state = EmulatorState(repo, token=token, **kwargs)
    for name, count in pools.items():
        state.add_pool(name.removeprefix("cluster:"), count)
    state.add_legacy(legacy)
    return state


def fleet_from_job_mix(csv_path: str | Path) -> dict[str, int]:
    """Pools shaped like a job-mix CSV: `cluster_pool` -> max `runner_label_count_at_snapshot`."""
    pools: dict[str, int] = {}
    with open(csv_path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"cluster_pool", "runner_label_count_at_snapshot"} - set(reader.fieldnames or [])
        if missing:
            raise EmulatorInputError(
                f"{csv_path} lacks column(s) {', '.join(sorted(missing))}; "
                "use a job mix like slurmgate/data/inferencex-job-mix.csv"
            )
        for row in reader:
            pool = (row["cluster_pool"] or "").strip().removeprefix("cluster:")
            count = (row["runner_label_count_at_snapshot"] or "").strip()
            if not pool or not count.isdigit():
                continue
            pools[pool] = max(pools.get(pool, 0), int(count))
    return dict(sorted(pools.items()))
