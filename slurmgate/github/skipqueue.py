"""Skip-queue authorization: which queued jobs' PR label was added by someone allowed to add it.

A workflow run for a pull request labelled `skip_queue` (the label is `skip_queue_label`) asks
for `ci-skip-queue-pr-<PR>` in its jobs' runs-on. Anyone who can push a workflow can write that
label, so it means nothing until it is verified: the job's run must be for that PR (GitHub's
`pull_requests` of the run), and the actor of the PR's last `labeled` event for the skip-queue
label, with no `unlabeled` after it, must be in `skip_queue_allow` (checked first, no request)
or an active member of `skip_queue_team`. With neither configured nobody is authorized and
nothing is read.

Answers are remembered per (repository, PR, label event, team) in the client's ETag cache file
(`StoredRecords`), so a steady tick reads each PR's events as a 304 and asks no membership
again until `MEMBERSHIP_RECHECK_S` has passed; a new label event is a new question. A lookup
that fails (network, 5xx, 403, a malformed answer) leaves the job unauthorized for this tick,
with one warning, and is asked again next tick: it never fails the read.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from slurmgate.admission.labels import MAX_PR_NUMBER, SKIP_QUEUE_PREFIX, LabelError, fold
from slurmgate.admission.model import Job, JobStatus
from slurmgate.github.client import JobSource
from slurmgate.github.errors import GitHubError
from slurmgate.github.etags import EtagCache, StoredRecords
from slurmgate.github.payloads import LabelEvent, ProblemMemory
from slurmgate.settings.admission import AdmissionSettings

log = logging.getLogger(__name__)

VERDICTS_KEY = "slurmgate:skip-queue-verdicts"
MAX_VERDICTS = 1000
MEMBERSHIP_RECHECK_S = 3600.0
"""A remembered team answer is asked again after this long (someone may have left the team)."""
MAX_PULL_REQUESTS_PER_READ = 50
"""Most pull requests verified in one read; the rest wait a tick (bounds the requests a flood
of skip-queue jobs can cost)."""

_PR_RE = re.compile(r"^[0-9]{1,10}$")


class SkipQueueClient(Protocol):
    """The reads authorization needs (all of them `GitHubClient`'s)."""

    etag_cache: EtagCache
    problems: ProblemMemory

    async def list_label_events(self, repo: str, number: int) -> list[LabelEvent]: ...

    async def team_member_active(self, org: str, team_slug: str, login: str) -> bool: ...


def skip_queue_pr(job: Job) -> int | None:
    """The PR number of the job's `ci-skip-queue-pr-<PR>` label; None when it has none.

    Raises LabelError when the number is not 1..2**31-1, or the job names two different PRs.
    """
    numbers: set[int] = set()
    for label in job.labels:
        folded = fold(label)
        if not folded.startswith(SKIP_QUEUE_PREFIX):
            continue
        raw = folded[len(SKIP_QUEUE_PREFIX) :]
        if not _PR_RE.match(raw) or not 1 <= int(raw) <= MAX_PR_NUMBER:
            raise LabelError(
                f"label {label!r} is not {SKIP_QUEUE_PREFIX}<pull request number>; "
                "write e.g. ci-skip-queue-pr-123"
            )
        numbers.add(int(raw))
    if len(numbers) > 1:
        raise LabelError(
            f"job names {len(numbers)} pull requests in {SKIP_QUEUE_PREFIX} labels; keep one"
        )
    return numbers.pop() if numbers else None


def deciding_label_event(events: Iterable[LabelEvent], label: str) -> LabelEvent | None:
    """The last `labeled` event of `label`, unless an `unlabeled` of it came later."""
    wanted = fold(label)
    deciding: LabelEvent | None = None
    for event in sorted(events, key=lambda e: e.id):  # GitHub numbers events in order
        if event.label == wanted:
            deciding = event if event.added else None
    return deciding


class TeamVerdict(BaseModel):
    """What the team said about the actor of one label event, and when it was asked."""

    model_config = ConfigDict(frozen=True, strict=True)

    actor: str
    member: bool
    checked_at: float


@dataclass(frozen=True, slots=True)
class _Ask:
    repo: str
    pr: int
    job_ids: tuple[int, ...]


class SkipQueueAuthorizer:
    """Verifies skip-queue labels for one client; see the module docstring for the rules."""

    def __init__(
        self,
        client: SkipQueueClient,
        settings: AdmissionSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.team = settings.skip_queue_team
        self.allow = settings.skip_queue_allow
        self.label = settings.skip_queue_label
        self.clock = clock
        self.verdicts = StoredRecords(client.etag_cache, VERDICTS_KEY, MAX_VERDICTS)

    @property
    def configured(self) -> bool:
        """False when neither a team nor an allow-list is set: nobody may skip the queue."""
        return bool(self.team or self.allow)

    async def authorized(
        self, jobs: Iterable[Job], sources: Mapping[int, JobSource]
    ) -> frozenset[int]:
        """The ids of the queued `jobs` whose skip-queue label is verified."""
        if not self.configured:
            return frozenset()
        asks = self._asks(jobs, sources)
        if len(asks) > MAX_PULL_REQUESTS_PER_READ:
            log.warning(
                "skip-queue: %d pull requests to verify, %d this read; the rest wait a tick",
                len(asks),
                MAX_PULL_REQUESTS_PER_READ,
            )
        granted: set[int] = set()
        for ask in asks[:MAX_PULL_REQUESTS_PER_READ]:
            try:
                allowed = await self._allowed(ask.repo, ask.pr)
            except GitHubError as exc:
                log.warning(
                    "skip-queue: PR %s#%d not verified this tick (jobs %s keep their score): %s",
                    ask.repo,
                    ask.pr,
                    ", ".join(str(j) for j in ask.job_ids),
                    exc,
                )
                continue
            if allowed:
                granted.update(ask.job_ids)
        return frozenset(granted)

    def _asks(self, jobs: Iterable[Job], sources: Mapping[int, JobSource]) -> list[_Ask]:
        """One question per (repository, PR), for the queued jobs whose run is for that PR."""
        wanted: dict[tuple[str, int], list[int]] = {}
        for job in sorted(jobs, key=lambda j: j.id):
            if job.status != JobStatus.QUEUED:
                continue
            try:
                pr = skip_queue_pr(job)
            except LabelError as exc:
                self.client.problems.report("skip-queue job", str(job.id), str(exc), "not verified")
                continue
            if pr is None:
                continue
            source = sources.get(job.id)
            if source is None or pr not in source.pull_requests:
                # the label is the workflow's word; only a run GitHub ties to the PR can use it
                self.client.problems.report(
                    "skip-queue job",
                    str(job.id),
                    f"asks for PR {pr}, but its run is not for that pull request",
                    "not verified",
                )
                continue
            wanted.setdefault((source.repo, pr), []).append(job.id)
        return [_Ask(repo, pr, tuple(ids)) for (repo, pr), ids in sorted(wanted.items())]

    async def _allowed(self, repo: str, pr: int) -> bool:
        event = deciding_label_event(await self.client.list_label_events(repo, pr), self.label)
        if event is None or event.actor is None:
            return False
        if event.actor in self.allow:
            return True
        if self.team is None:
            return False
        org, team_slug = self.team.split("/", 1)
        key = f"{fold(repo)}#{pr}#{event.id}#{fold(self.team)}"
        remembered = self._remembered(key, event.actor)
        if remembered is not None:
            return remembered.member
        member = await self.client.team_member_active(org, team_slug, event.actor)
        verdict = TeamVerdict(actor=event.actor, member=member, checked_at=self.clock())
        self.verdicts.put(key, verdict.model_dump())
        return member

    def _remembered(self, key: str, actor: str) -> TeamVerdict | None:
        record = self.verdicts.get(key)
        if record is None:
            return None
        try:
            verdict = TeamVerdict.model_validate(record)
        except ValidationError:
            return None
        age = self.clock() - verdict.checked_at
        if verdict.actor != actor or not 0 <= age < MEMBERSHIP_RECHECK_S:
            return None
        return verdict
