"""GitHub's runner, run and job objects: checked against their OpenAPI shape, then model records.

Also the two objects skip-queue authorization reads: a pull request's label events (who added
or removed which label) and a team membership (active or pending).

GitHub is an outside system: an object of the wrong shape (a label given as a string, a
missing id, a timestamp without an offset) is refused here as `MalformedPayload`, and the
listing that carried it skips it and goes on. A job status this module does not know (GitHub
adds them: `action_required`, `waiting`, ...) is not malformed: it becomes
`JobStatus.UNKNOWN`, which is not active, so nothing is admitted for it and no lease is
released because of it. `ProblemMemory` makes each skipped item one warning, not one a tick.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
)
from pydantic import ValidationError as PydanticValidationError

from slurmgate.admission.labels import MAX_PR_NUMBER
from slurmgate.admission.model import Job, JobStatus, Runner
from slurmgate.errors import ExternalError
from slurmgate.github.etags import EtagCache
from slurmgate.github.scope import is_login

log = logging.getLogger(__name__)

MAX_LABEL_LENGTH = 256
"""Longest label name accepted (GitHub's own runner labels are far shorter)."""
MAX_LABELS = 256
"""Most labels one runner or job may carry (GitHub allows 100 custom labels on a runner)."""
MAX_TEXT_LENGTH = 4096
"""Longest name, status or conclusion accepted; these only reach logs and the board."""
MAX_ID = 2**63 - 1  # GitHub ids are int64
BOT_SUFFIX = "[bot]"
MAX_LOGIN_LENGTH = 39 + len(BOT_SUFFIX)
"""A user login is at most 39 characters; a GitHub App acts as `<app-slug>[bot]`."""
MAX_RUN_PULL_REQUESTS = 100

_NOT_STARTED = (JobStatus.QUEUED, JobStatus.WAITING, JobStatus.REQUESTED, JobStatus.PENDING)
_KNOWN_STATUSES = frozenset(s.value for s in JobStatus if s is not JobStatus.UNKNOWN)


class MalformedPayload(ExternalError):
    """A GitHub object whose shape is not the one GitHub's OpenAPI description gives it."""

    def __init__(self, kind: str, item_id: str, problem: str) -> None:
        self.kind = kind
        self.item_id = item_id
        self.problem = problem
        super().__init__(f"malformed {kind} {item_id} from GitHub: {problem}")


def _printable(value: str) -> str:
    # Label names reach URLs and log lines; a control character in one is not GitHub's data.
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError("contains a control character")
    return value


def _timestamp(value: Any) -> datetime:
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError("is not an ISO 8601 date-time string")
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError("has no UTC offset (GitHub's date-time always has one)")
    return moment


def _login(value: str) -> str:
    # _printable first: the login pattern's `$` would let a trailing newline through
    if not is_login(_printable(value).removesuffix(BOT_SUFFIX)):
        raise ValueError("is not a GitHub login")
    return value


GitHubId = Annotated[int, Field(strict=True, ge=1, le=MAX_ID)]
IssueNumber = Annotated[int, Field(strict=True, ge=1, le=MAX_PR_NUMBER)]
Login = Annotated[
    StrictStr, Field(min_length=1, max_length=MAX_LOGIN_LENGTH), AfterValidator(_login)
]
Label = Annotated[
    StrictStr,
    Field(min_length=1, max_length=MAX_LABEL_LENGTH),
    AfterValidator(_printable),
]
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT_LENGTH)]
Timestamp = Annotated[datetime, BeforeValidator(_timestamp)]


class _Wire(BaseModel):
    # Fields slurmgate does not read are ignored: GitHub adds fields, and that is no fault.
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class RunnerLabelPayload(_Wire):
    """One entry of a runner's `labels`: an object with a name, not a bare string."""

    name: Label
    type: Text | None = None


class RunnerPayload(_Wire):
    """The `runner` object, as far as slurmgate reads it."""

    id: GitHubId
    name: Text
    status: Text
    busy: StrictBool
    labels: Annotated[list[RunnerLabelPayload], Field(max_length=MAX_LABELS)]


class RunPayload(_Wire):
    """The `workflow-run` object: slurmgate needs only its id to list its jobs."""

    id: GitHubId


class RunPullRequestPayload(_Wire):
    """One `pull-request-minimal` of a run's `pull_requests`: only its number is read."""

    number: IssueNumber


class RunPullRequestsPayload(_Wire):
    pull_requests: Annotated[list[RunPullRequestPayload], Field(max_length=MAX_RUN_PULL_REQUESTS)]


class ActorPayload(_Wire):
    """The `simple-user` who acted, as far as slurmgate reads it."""

    login: Login


class IssueLabelPayload(_Wire):
    name: Label


class LabelEventPayload(_Wire):
    """A `labeled-issue-event` or `unlabeled-issue-event`, as far as slurmgate reads it.

    GitHub sends `actor: null` for an account that was deleted since.
    """

    id: GitHubId
    event: Text
    actor: ActorPayload | None
    label: IssueLabelPayload


class TeamMembershipPayload(_Wire):
    """The `team-membership` object: only `state` is read."""

    state: Text


class JobPayload(_Wire):
    """The `job` object, as far as slurmgate reads it."""

    id: GitHubId
    run_id: GitHubId
    run_attempt: GitHubId | None = None
    name: Text | None = None
    labels: Annotated[list[Label], Field(max_length=MAX_LABELS)]
    status: Text
    conclusion: Text | None = None
    created_at: Timestamp | None = None
    started_at: Timestamp | None = None
    completed_at: Timestamp | None = None
    runner_id: Annotated[int, Field(strict=True, ge=0, le=MAX_ID)] | None = None
    runner_name: Text | None = None


def item_id(data: Any) -> str:
    """The item's id for logs and the problem memory; an item without a usable id is named by a
    digest of its content, so two different bad items are two problems, the same one is one."""
    if isinstance(data, Mapping):
        value = data.get("id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_ID:
            return str(value)
    try:
        rendered = json.dumps(data, sort_keys=True, default=repr)
    except (RecursionError, ValueError):
        rendered = type(data).__name__
    return f"(no id, #{hashlib.sha256(rendered.encode()).hexdigest()[:8]})"


def _check(model: type[_Wire], kind: str, data: Any) -> Any:
    try:
        return model.model_validate(data)
    except PydanticValidationError as exc:
        raise MalformedPayload(kind, item_id(data), _shape_problem(exc)) from None


def _shape_problem(exc: PydanticValidationError) -> str:
    """What is wrong, by field and rule, never the hostile value itself."""
    parts = [
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors(include_url=False, include_input=False)[:5]
    ]
    return "; ".join(parts)[:500]


def parse_runner(data: Any) -> Runner:
    """A `runner` object as a model Runner; raises MalformedPayload for any other shape."""
    payload: RunnerPayload = _check(RunnerPayload, "runner", data)
    return Runner(
        id=payload.id,
        name=payload.name,
        online=payload.status == "online",
        busy=payload.busy,
        labels=tuple(label.name for label in payload.labels),
        read_only=frozenset(label.name for label in payload.labels if label.type == "read-only"),
    )


def parse_run_id(data: Any) -> int:
    """The id of a `workflow-run` object; raises MalformedPayload when it has none."""
    payload: RunPayload = _check(RunPayload, "run", data)
    return payload.id


def parse_run_pull_requests(data: Any) -> frozenset[int]:
    """The pull request numbers a `workflow-run` object lists: empty when it lists none, or
    lists them in a shape slurmgate does not read (so nothing is claimed for the run)."""
    try:
        payload = RunPullRequestsPayload.model_validate(data)
    except PydanticValidationError:
        return frozenset()
    return frozenset(pr.number for pr in payload.pull_requests)


LABEL_EVENT_KINDS = frozenset({"labeled", "unlabeled"})


@dataclass(frozen=True, slots=True)
class LabelEvent:
    """One `labeled` (added) or `unlabeled` event of an issue or pull request; `label` and
    `actor` are case-folded (GitHub compares both case-insensitively)."""

    id: int
    added: bool
    label: str
    actor: str | None


def parse_label_event(data: Any) -> LabelEvent | None:
    """A label event of an issue-events listing, or None for an event of any other kind.

    Raises MalformedPayload for an object without a string `event`, or a label event of the
    wrong shape: the one event slurmgate cannot read might be the one that decides.
    """
    kind = data.get("event") if isinstance(data, Mapping) else None
    if not isinstance(kind, str):
        raise MalformedPayload("issue event", item_id(data), "event: is not a string")
    if kind not in LABEL_EVENT_KINDS:
        return None
    payload: LabelEventPayload = _check(LabelEventPayload, "issue event", data)
    return LabelEvent(
        id=payload.id,
        added=payload.event == "labeled",
        label=payload.label.name.casefold(),
        actor=payload.actor.login.casefold() if payload.actor is not None else None,
    )


def parse_team_membership(data: Any) -> bool:
    """True when a `team-membership` object is active (a pending invitation is not)."""
    payload: TeamMembershipPayload = _check(TeamMembershipPayload, "team membership", data)
    return payload.state == "active"


def parse_job(data: Any) -> Job:
    """A `job` object as a model Job; started_at of a job that has not started is dropped.

    An unknown status becomes `JobStatus.UNKNOWN` (not active); any other shape problem
    raises MalformedPayload.
    """
    payload: JobPayload = _check(JobPayload, "job", data)
    status = JobStatus(payload.status) if payload.status in _KNOWN_STATUSES else JobStatus.UNKNOWN
    created = payload.created_at or payload.started_at
    if created is None:
        raise MalformedPayload("job", str(payload.id), "has neither created_at nor started_at")
    return Job(
        id=payload.id,
        run_id=payload.run_id,
        run_attempt=payload.run_attempt or 1,
        name=payload.name or "",
        labels=tuple(payload.labels),
        status=status,
        created_at=created,
        conclusion=payload.conclusion,
        runner_id=payload.runner_id,
        runner_name=payload.runner_name,
        started_at=None if status in _NOT_STARTED else payload.started_at,
        completed_at=payload.completed_at,
    )


class ProblemMemory:
    """Warns once per problem: keyed by kind, item id and a digest of what is wrong.

    The keys live in the client's ETag cache under one reserved key, so the file cache a
    controller keeps across flow runs also keeps a malformed runner from warning every tick.
    At most `max_entries` keys are kept, the oldest forgotten first.
    """

    STORE_KEY = "slurmgate:reported-problems"

    def __init__(self, store: EtagCache, max_entries: int = 1000) -> None:
        self._store = store
        self.max_entries = max_entries
        self._keys: dict[str, None] | None = None

    def _known(self) -> dict[str, None]:
        if self._keys is None:
            entry = self._store.get(self.STORE_KEY)
            stored = entry[1] if entry is not None else None
            keys = stored if isinstance(stored, list) else []
            self._keys = {str(k): None for k in keys[-self.max_entries :]}
        return self._keys

    def report(self, kind: str, item: str, problem: str, consequence: str) -> bool:
        """Log `problem` as a warning unless this item already had it; True when logged."""
        digest = hashlib.sha256(problem.encode()).hexdigest()[:12]
        key = f"{kind}:{item}:{digest}"
        known = self._known()
        if key in known:
            return False
        known[key] = None
        while len(known) > self.max_entries:
            del known[next(iter(known))]
        self._store.put(self.STORE_KEY, "", list(known))
        log.warning("%s %s from GitHub %s: %s", kind, item, consequence, problem)
        return True

    def __len__(self) -> int:
        return len(self._known())
