"""The GitHub webhook relay: verified `workflow_job` deliveries become Prefect events.

Prefect's open-source server has deployment triggers on events but no incoming webhooks, so this
small starlette app sits between GitHub and Prefect's `POST /api/events`:

1. nothing is read of a request without a well-formed `X-Hub-Signature-256` (401), nor of an
   event other than `workflow_job` and `ping` (202, ignored: the relay acts on no other event,
   so verifying one would only cost its body); a `workflow_job` delivery is a few KB, so a
   `Content-Length` over `max_body_bytes` (1 MiB; GitHub's own cap, 25 MB, is for events the
   relay ignores) is refused with 413 before a byte of it is read, a streamed (chunked) body is
   cut off at the same size, a body that takes longer than `body_timeout_s` gets 408, and all bodies
   held at once share one `max_buffered_bytes` budget (503 beyond it). Under uvicorn
   (`server_options`), headers must arrive within `header_timeout_s` and `max_header_bytes`,
   and more than `max_connections` open connections are answered 503;
2. every request must carry a valid `X-Hub-Signature-256` (HMAC-SHA256 of the raw body with the
   shared secret, compared in constant time), else 401 and nothing happens;
3. `ping` is answered, other event types are acknowledged (202) and ignored;
4. a `workflow_job` body must validate as `WorkflowJobDelivery` (JSON nested at most 200 deep,
   every field the relay reads of the right type), else 400 with a one-line reason;
5. a `workflow_job` delivery is **stale** when its newest job timestamp (normally the action's
   own: `created_at` for queued, `started_at` for in_progress, `completed_at` for completed) is
   older than `max_age_s`, or more than `max_skew_s` in the future: 403, nothing posted. GitHub
   sends no timestamp header, so this bounds replays of captured deliveries; redelivering an old
   delivery by hand is refused too, and the reconcile schedule covers what it would have done;
6. both the `X-GitHub-Delivery` id and the SHA-256 of the signed body are remembered (bounded
   LRU with a TTL, in memory): a repeat of either answers 200 with `duplicate: true` and posts
   nothing. The id alone is not enough, because the signature does not cover it: a captured
   body replayed under fresh ids would otherwise post again. After a restart the memory is
   empty, and the freshness window (5) is what still bounds a replay;
7. with a `job_store`, the job's state is written to the job-event store (`jobstore.py`) that
   the reconcile tick reads its jobs from; a job past the store's bounds is not stored (one
   warning), and a store that cannot be written costs only the store (the tick's full read
   repairs it), never the Prefect event;
8. the event `github.workflow_job.<action>` is posted with a short timeout (well inside GitHub's
   10 s answer rule). If Prefect does not take it, the answer is 503 and the delivery is
   forgotten, so a redelivery can succeed.

The secret and the Prefect auth string are never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from slurmgate.admission.model import Job, JobStatus
from slurmgate.errors import InputError
from slurmgate.github.jobstore import JobEventStore
from slurmgate.github.scope import is_repo
from slurmgate.serving import ThreadedServer

log = logging.getLogger("slurmgate.github.webhook")

EVENT_PREFIX = "github.workflow_job."
SIGNATURE_HEADER = "x-hub-signature-256"
DELIVERY_HEADER = "x-github-delivery"
EVENT_HEADER = "x-github-event"
# GitHub caps webhook payloads at 25 MB and drops larger ones without sending them.
GITHUB_MAX_PAYLOAD_BYTES = 25_000_000
# A workflow_job delivery (the job, its steps, the repository, the sender) is a few KB; a body
# is read before its signature can be checked, so unverified bodies are kept this small.
MAX_JOB_BODY_BYTES = 1 << 20
# The events whose bodies the relay reads: the one it acts on, and GitHub's hook check.
READ_EVENTS = frozenset({"workflow_job", "ping"})
# The job timestamp that dates each action's delivery.
ACTION_TIMESTAMP = {
    "queued": "created_at",
    "waiting": "created_at",
    "in_progress": "started_at",
    "completed": "completed_at",
}
_ACTION_PATTERN = r"^[a-z_]{1,32}$"
# GitHub's delivery ids are GUIDs; anything longer is not GitHub's and is not worth keeping.
_DELIVERY_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_LENGTH_RE = re.compile(r"^[0-9]{1,20}$")
_SIGNATURE_RE = re.compile(r"^sha256=[0-9a-fA-F]{64}$")
_NAMESPACE = uuid.UUID("5b2f7f0e-3c41-4f53-9a55-6c1d8e7a0b11")


class RelaySettings(BaseModel):
    """What the relay needs: the shared secret, Prefect's API, and its limits."""

    model_config = ConfigDict(frozen=True)

    secret: SecretStr = Field(description="The webhook's shared secret (GitHub: webhook settings).")
    prefect_api_url: str = Field(description="Prefect API base, e.g. http://127.0.0.1:4200/api.")
    prefect_auth_string: SecretStr | None = Field(
        default=None, description="user:password when the server sets an API auth string."
    )
    max_age_s: float = Field(default=600.0, gt=0, description="Older deliveries are stale.")
    max_skew_s: float = Field(default=60.0, ge=0, description="Tolerated clock skew (future).")
    dedupe_entries: int = Field(
        default=20_000, ge=2, description="Delivery ids and body digests remembered (two each)."
    )
    dedupe_ttl_s: float = Field(default=86_400.0, gt=0, description="How long an id is kept.")
    post_timeout_s: float = Field(default=5.0, gt=0, le=9.0, description="Prefect post timeout.")
    max_body_bytes: int = Field(
        default=MAX_JOB_BODY_BYTES,
        ge=1024,
        le=GITHUB_MAX_PAYLOAD_BYTES,
        description="Largest workflow_job body read (413 beyond); such a delivery is a few KB.",
    )
    max_buffered_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Bytes of bodies held at once over all requests (503 beyond).",
    )
    body_timeout_s: float = Field(
        default=10.0, gt=0, description="Time a whole body may take to arrive (408 beyond)."
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="Time request headers may take (connection closed)."
    )
    max_header_bytes: int = Field(
        default=16 * 1024, ge=1024, description="Largest request head (400 beyond)."
    )
    max_connections: int = Field(
        default=64, ge=1, description="Open connections served at once (503 beyond)."
    )
    job_store: Path | None = Field(
        default=None,
        description="The job-event store the reconcile tick reads its jobs from (SQLite; "
        "usually job-events.sqlite in the state directory). None: events only go to Prefect.",
    )

    @field_validator("secret")
    @classmethod
    def _secret_not_empty(cls, value: SecretStr) -> SecretStr:
        if not value.get_secret_value().strip():
            raise ValueError("the webhook secret is empty; set the same secret as on GitHub")
        return value

    @field_validator("prefect_api_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"prefect_api_url {value!r} must start with http:// or https:// "
                "(e.g. http://127.0.0.1:4200/api)"
            )
        return value.rstrip("/")

    @model_validator(mode="after")
    def _one_body_fits_the_budget(self) -> Self:
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_bytes {self.max_buffered_bytes} is below max_body_bytes "
                f"{self.max_body_bytes}: a largest body could never be read; raise it"
            )
        return self


def signature(secret: str, body: bytes | bytearray) -> str:
    """GitHub's `X-Hub-Signature-256` value for a body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(secret: str, body: bytes | bytearray, header: str | None) -> bool:
    """True when `header` is the body's HMAC-SHA256 under `secret` (constant-time compare)."""
    if not header:
        return False
    return hmac.compare_digest(signature(secret, body).encode(), header.strip().encode())


def body_key(body: bytes | bytearray) -> str:
    """The de-duplication key of a signed body: its SHA-256, which the signature does cover."""
    return "sha256:" + hashlib.sha256(body).hexdigest()


class DeliveryCache:
    """Keys seen recently (delivery ids, body digests): bounded in size (oldest first) and age."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._max = max_entries
        self._ttl = ttl_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._seen)

    def claim(self, *keys: str) -> bool:
        """Record every key; False, recording none, when any of them was already recorded."""
        now = self._clock()
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if now - at < self._ttl:
                break
            del self._seen[oldest]
        if any(key in self._seen for key in keys):
            return False
        for key in keys:
            self._seen[key] = now
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return True

    def forget(self, *keys: str) -> None:
        for key in keys:
            self._seen.pop(key, None)


class StaleDelivery(InputError):
    """A delivery dated outside the accepted window."""


class BadDelivery(InputError):
    """A signed delivery whose body is not a usable workflow_job payload."""


class RefusedBody(InputError):
    """A body the relay stops reading: larger than the limit, too slow, or no memory left."""

    def __init__(self, status: int, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.outcome = outcome


class WorkflowJob(BaseModel):
    """The fields of a delivery's `workflow_job` that the relay reads; the rest is ignored."""

    model_config = ConfigDict(frozen=True)

    id: StrictInt = Field(gt=0)
    run_id: StrictInt | None = None
    run_attempt: StrictInt | None = None
    name: str | None = None
    status: str | None = None
    conclusion: str | None = None
    labels: list[str] | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    runner_name: str | None = None
    runner_id: StrictInt | None = None


class DeliveryRepository(BaseModel):
    """The delivery's `repository`: only its OWNER/NAME, which shapes the event's resource id."""

    model_config = ConfigDict(frozen=True)

    full_name: str

    @field_validator("full_name")
    @classmethod
    def _owner_slash_name(cls, value: str) -> str:
        if not is_repo(value):
            raise ValueError("is not OWNER/NAME")
        return value


class WorkflowJobDelivery(BaseModel):
    """A `workflow_job` delivery body, as far as the relay reads it."""

    model_config = ConfigDict(frozen=True)

    action: str = Field(pattern=_ACTION_PATTERN)
    workflow_job: WorkflowJob
    repository: DeliveryRepository


def _reason(exc: ValidationError) -> str:
    """A validation failure as one line: the first field and what is wrong, never the input."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return " ".join(f"{where}: {first['msg']}{more}".split())[:300]


def parse_delivery(body: bytes | bytearray) -> WorkflowJobDelivery:
    """Parse and validate a workflow_job body; BadDelivery with a one-line reason otherwise.

    The JSON is parsed by pydantic's own parser, which refuses nesting deeper than 200 levels
    (GitHub's payloads nest a handful), so a hostile body cannot exhaust Python's stack.
    """
    try:
        return WorkflowJobDelivery.model_validate_json(body)
    except ValidationError as exc:
        raise BadDelivery(_reason(exc)) from None


def _utc(at: datetime) -> datetime:
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def delivery_time(delivery: WorkflowJobDelivery) -> datetime:
    """When the delivery was made, as near as the payload tells: the newest job timestamp.

    The action's own timestamp (ACTION_TIMESTAMP) is usually the newest. Taking the newest of
    all keeps a job that waited (for an approval, say) before it was queued from looking stale.
    """
    job = delivery.workflow_job
    times = [
        _utc(at) for at in (job.created_at, job.started_at, job.completed_at) if at is not None
    ]
    if not times:
        field = ACTION_TIMESTAMP.get(delivery.action, "created_at")
        raise BadDelivery(f"workflow_job.{field} is missing")
    return max(times)


def check_fresh(
    delivery: WorkflowJobDelivery, now: datetime, max_age_s: float, skew_s: float
) -> None:
    """Raise StaleDelivery when the delivery is older than max_age_s or too far in the future."""
    at = delivery_time(delivery)
    age = (now - at).total_seconds()
    if age > max_age_s:
        raise StaleDelivery(f"delivery is {age:.0f} s old (limit {max_age_s:.0f} s)")
    if age < -skew_s:
        raise StaleDelivery(f"delivery is dated {-age:.0f} s in the future")


def job_of(delivery: WorkflowJobDelivery) -> Job | None:
    """The delivery's job as the planner reads jobs, or None when it lacks what a job needs
    (run id, attempt, name, creation time) or its status is not one slurmgate knows."""
    job = delivery.workflow_job
    try:
        status = JobStatus(job.status or delivery.action)
    except ValueError:
        return None
    if job.run_id is None or job.created_at is None or status is JobStatus.UNKNOWN:
        return None
    return Job(
        id=job.id,
        run_id=job.run_id,
        run_attempt=job.run_attempt or 1,
        name=job.name or str(job.id),
        labels=tuple(job.labels or ()),
        status=status,
        created_at=_utc(job.created_at),
        conclusion=job.conclusion,
        runner_id=job.runner_id,
        runner_name=job.runner_name,
        started_at=_utc(job.started_at) if job.started_at else None,
        completed_at=_utc(job.completed_at) if job.completed_at else None,
    )


def repo_resource_id(full_name: str) -> str:
    """`acme/gpu-ci` -> `github.repo.acme.gpu-ci`."""
    owner, _, name = full_name.partition("/")
    return f"github.repo.{owner}.{name}"


def event_for(
    delivery: WorkflowJobDelivery, delivery_id: str, received: datetime
) -> dict[str, Any]:
    """The Prefect event for one workflow_job delivery (Prefect's event JSON schema)."""
    action = delivery.action
    job = delivery.workflow_job
    full_name = delivery.repository.full_name
    dated = getattr(job, ACTION_TIMESTAMP.get(action, "created_at"))
    return {
        # derived from the delivery id: a replayed post is the same event to Prefect as well
        "id": str(uuid.uuid5(_NAMESPACE, delivery_id)),
        "occurred": received.isoformat(),
        "event": f"{EVENT_PREFIX}{action}",
        "resource": {
            "prefect.resource.id": repo_resource_id(full_name),
            "prefect.resource.name": full_name,
            "github.workflow_job.id": str(job.id),
        },
        "related": [
            {
                "prefect.resource.id": f"github.workflow_job.{job.id}",
                "prefect.resource.role": "workflow-job",
                "prefect.resource.name": job.name or str(job.id),
            }
        ],
        "payload": {
            "action": action,
            "delivery": delivery_id,
            "job_id": job.id,
            "run_id": job.run_id,
            "run_attempt": job.run_attempt,
            "labels": list(job.labels or []),
            "status": job.status,
            "conclusion": job.conclusion,
            "runner_name": job.runner_name,
            "repository": full_name,
            "github_timestamp": _utc(dated).isoformat() if dated is not None else None,
        },
    }


class BodyBudget:
    """Bytes of request bodies held at once, over all requests: one bound on the relay's memory.

    Requests run on one event loop and nothing awaits between the check and the count, so
    no lock is needed.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        self.held -= size


@asynccontextmanager
async def read_body(
    request: Request, settings: RelaySettings, budget: BodyBudget
) -> AsyncIterator[bytearray]:
    """The request body, read within the size, time and memory limits; RefusedBody otherwise.

    Its bytes count against `budget` until the block ends.
    """
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not _LENGTH_RE.match(declared):
            raise RefusedBody(400, "bad-length", "Content-Length is not a number of bytes")
        if int(declared) > limit:
            raise RefusedBody(
                413, "too-large", f"Content-Length {int(declared)} is over the {limit} byte limit"
            )
    body = bytearray()
    try:
        try:
            async with asyncio.timeout(settings.body_timeout_s):
                async for chunk in request.stream():
                    if len(body) + len(chunk) > limit:
                        raise RefusedBody(413, "too-large", f"body is over the {limit} byte limit")
                    if not budget.take(len(chunk)):
                        raise RefusedBody(503, "busy", "too many bodies in flight; retry later")
                    body += chunk
        except TimeoutError:
            raise RefusedBody(
                408, "too-slow", f"body did not arrive within {settings.body_timeout_s:g} s"
            ) from None
        except ClientDisconnect:
            raise RefusedBody(400, "disconnected", "client went away mid-body") from None
        yield body
    finally:
        budget.give_back(len(body))


def _shown(value: str) -> str:
    """A header value as logs show it: short and printable (it may come from anyone)."""
    return value[:64].encode("ascii", "replace").decode() if value else "-"


class PrefectEvents:
    """Posts events to Prefect's `POST /api/events` with httpx (basic auth when configured)."""

    def __init__(self, settings: RelaySettings, transport: httpx.AsyncBaseTransport | None = None):
        auth = None
        if settings.prefect_auth_string is not None:
            user, _, password = settings.prefect_auth_string.get_secret_value().partition(":")
            auth = httpx.BasicAuth(user, password)
        self._client = httpx.AsyncClient(
            base_url=settings.prefect_api_url,
            timeout=settings.post_timeout_s,
            auth=auth,
            transport=transport,
        )

    async def post(self, events: list[dict[str, Any]]) -> None:
        response = await self._client.post("/events", json=events)
        response.raise_for_status()

    async def aclose(self) -> None:
        await self._client.aclose()


def create_app(
    settings: RelaySettings,
    *,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The relay as an ASGI app; `app.state.stats` counts what it did."""
    secret = settings.secret.get_secret_value()
    deliveries = DeliveryCache(settings.dedupe_entries, settings.dedupe_ttl_s)
    budget = BodyBudget(settings.max_buffered_bytes)
    stats: dict[str, int] = {
        "posted": 0,
        "duplicates": 0,
        "unauthorized": 0,
        "stale": 0,
        "ignored": 0,
        "bad": 0,
        "post_failed": 0,
        "too_large": 0,
        "too_slow": 0,
        "busy": 0,
        "stored": 0,
        "not_stored": 0,
    }
    store = JobEventStore(settings.job_store) if settings.job_store is not None else None
    refusal_stat = {
        "too-large": "too_large",
        "head-too-large": "too_large",
        "too-slow": "too_slow",
        "busy": "busy",
    }
    poster: PrefectEvents | None = None
    lock = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal poster
        poster = PrefectEvents(settings, transport)
        try:
            yield
        finally:
            await poster.aclose()

    def answer(status: int, outcome: str, **extra: Any) -> JSONResponse:
        return JSONResponse({"outcome": outcome, **extra}, status_code=status)

    def unread(status: int, outcome: str, **extra: Any) -> JSONResponse:
        # the body is still on the wire: the connection cannot be reused
        response = answer(status, outcome, **extra)
        response.headers["connection"] = "close"
        return response

    async def hook(request: Request) -> JSONResponse:
        delivery = request.headers.get(DELIVERY_HEADER, "")
        kind = request.headers.get(EVENT_HEADER, "")
        head_size = sum(len(name) + len(value) + 4 for name, value in request.headers.raw)
        if head_size > settings.max_header_bytes:
            # uvicorn's h11 caps a head that arrives in pieces; one that arrives whole is sized here
            stats["too_large"] += 1
            limit = settings.max_header_bytes
            return unread(431, "head-too-large", detail=f"headers are over the {limit} byte limit")
        claimed = request.headers.get(SIGNATURE_HEADER)
        if claimed is None or not _SIGNATURE_RE.match(claimed.strip()):
            # no body can match a missing or malformed signature: refuse before reading it
            stats["unauthorized"] += 1
            outcome = "unsigned" if claimed is None else "bad-signature"
            log.warning(
                "rejected delivery=%s event=%s: %s", _shown(delivery), _shown(kind), outcome
            )
            return unread(401, outcome)
        if kind not in READ_EVENTS:
            stats["ignored"] += 1
            return unread(202, "ignored", event=kind)
        try:
            async with read_body(request, settings, budget) as body:
                return await judge(body, delivery, kind, request)
        except RefusedBody as exc:
            stats[refusal_stat.get(exc.outcome, "bad")] += 1
            log.warning("refused delivery=%s: %s", _shown(delivery), exc)
            return unread(exc.status, exc.outcome, detail=str(exc))

    async def judge(body: bytearray, delivery: str, kind: str, request: Request) -> JSONResponse:
        if not verify_signature(secret, body, request.headers.get(SIGNATURE_HEADER)):
            stats["unauthorized"] += 1
            unsigned = SIGNATURE_HEADER not in request.headers
            log.warning(
                "rejected delivery=%s event=%s: %s",
                _shown(delivery),
                _shown(kind),
                "unsigned" if unsigned else "bad signature",
            )
            return answer(401, "unsigned" if unsigned else "bad-signature")
        if kind == "ping":
            return answer(200, "pong")
        if not _DELIVERY_RE.match(delivery):
            stats["bad"] += 1
            detail = "X-GitHub-Delivery header is " + ("not an id" if delivery else "missing")
            return answer(400, "bad-delivery", detail=detail)
        try:
            parsed = parse_delivery(body)
            received = clock()
            check_fresh(parsed, received, settings.max_age_s, settings.max_skew_s)
            event = event_for(parsed, delivery, received)
        except StaleDelivery as exc:
            stats["stale"] += 1
            log.warning("rejected delivery=%s: stale: %s", delivery, exc)
            return answer(403, "stale", detail=str(exc))
        except BadDelivery as exc:
            stats["bad"] += 1
            log.warning("rejected delivery=%s: %s", delivery, exc)
            return answer(400, "bad-delivery", detail=str(exc))
        keys = (delivery, body_key(body))
        async with lock:
            fresh = deliveries.claim(*keys)
        if not fresh:
            stats["duplicates"] += 1
            log.info("duplicate delivery=%s ignored", delivery)
            return answer(200, "duplicate", duplicate=True)
        if store is not None:
            await keep(parsed, delivery)
        assert poster is not None, "the relay runs inside its lifespan"
        try:
            await poster.post([event])
        except httpx.HTTPError as exc:
            async with lock:
                deliveries.forget(*keys)
            stats["post_failed"] += 1
            log.error(
                "delivery=%s: Prefect did not take the event: %s", delivery, type(exc).__name__
            )
            return answer(503, "prefect-unavailable")
        stats["posted"] += 1
        log.info(
            "posted %s job=%s delivery=%s",
            event["event"],
            event["payload"]["job_id"],
            delivery,
        )
        return answer(202, "posted", event=event["event"], id=event["id"])

    async def keep(parsed: WorkflowJobDelivery, delivery: str) -> None:
        """Write the job's state to the store (in a thread: SQLite blocks)."""
        assert store is not None
        job = job_of(parsed)
        try:
            kept = job is not None and await asyncio.to_thread(
                store.record, job, parsed.repository.full_name
            )
        except Exception as exc:  # sqlite3 or OS errors: the tick's full read repairs it
            log.warning("delivery=%s: job store not written: %s", delivery, type(exc).__name__)
            kept = False
        stats["stored" if kept else "not_stored"] += 1

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, **stats})

    app = Starlette(
        routes=[
            Route("/webhook", hook, methods=["POST"]),
            Route("/healthz", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.stats = stats
    app.state.deliveries = deliveries
    app.state.budget = budget
    return app


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head takes too long.

    uvicorn itself waits for headers forever (its keep-alive timer stops at the first byte),
    which lets a client that sends one byte at a time hold a connection open (slowloris).
    """

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self._header_timer is None and (before is None or before.response_complete):
            self._arm_header_timer()  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self.cycle is not before:
            self._cancel_header_timer()  # its head is complete: the body has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _head_too_slow(self) -> None:
        self._header_timer = None
        log.info("closed a connection whose request head took over %g s", self.header_timeout_s)
        self.transport.close()


def server_options(settings: RelaySettings) -> dict[str, Any]:
    """The uvicorn.Config options that enforce the relay's connection and header limits."""
    protocol = type(
        "RelayHttpProtocol", (_HeaderDeadline,), {"header_timeout_s": settings.header_timeout_s}
    )
    return {
        "http": protocol,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": 5,
    }


class RelayServer(ThreadedServer):
    """The relay under uvicorn on a free loopback port, in a daemon thread (tests, demo, bench)."""

    what = "webhook relay"

    def __init__(self, settings: RelaySettings, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = create_app(settings)
        super().__init__(self.app, host, port, **server_options(settings))
        self.url = f"{self.base_url}/webhook"

    @property
    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.app.state.stats
        return stats
