"""The GitHub webhook relay: verified `workflow_job` deliveries become Prefect events.

Prefect's open-source server has deployment triggers on events but no incoming webhooks, so this
small starlette app sits between GitHub and Prefect's `POST /api/events`:

1. every request must carry a valid `X-Hub-Signature-256` (HMAC-SHA256 of the raw body with the
   shared secret, compared in constant time), else 401 and nothing happens;
2. `ping` is answered, other event types are acknowledged (202) and ignored;
3. a `workflow_job` delivery is **stale** when its newest job timestamp (normally the action's
   own: `created_at` for queued, `started_at` for in_progress, `completed_at` for completed) is
   older than `max_age_s`, or more than `max_skew_s` in the future: 403, nothing posted. GitHub
   sends no timestamp header, so this bounds replays of captured deliveries; redelivering an old
   delivery by hand is refused too, and the reconcile schedule covers what it would have done;
4. `X-GitHub-Delivery` ids are remembered (bounded LRU with a TTL): a repeat answers 200 with
   `duplicate: true` and posts nothing;
5. the event `github.workflow_job.<action>` is posted with a short timeout (well inside GitHub's
   10 s answer rule). If Prefect does not take it, the answer is 503 and the delivery id is
   forgotten, so a redelivery can succeed.

The secret and the Prefect auth string are never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from slurmgate.errors import InputError
from slurmgate.github.scope import is_repo
from slurmgate.serving import ThreadedServer

log = logging.getLogger("slurmgate.github.webhook")

EVENT_PREFIX = "github.workflow_job."
SIGNATURE_HEADER = "x-hub-signature-256"
DELIVERY_HEADER = "x-github-delivery"
EVENT_HEADER = "x-github-event"
# The job timestamp that dates each action's delivery.
ACTION_TIMESTAMP = {
    "queued": "created_at",
    "waiting": "created_at",
    "in_progress": "started_at",
    "completed": "completed_at",
}
_ACTION_RE = re.compile(r"^[a-z_]{1,32}$")
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
    dedupe_entries: int = Field(default=10_000, ge=1, description="Delivery ids remembered.")
    dedupe_ttl_s: float = Field(default=86_400.0, gt=0, description="How long an id is kept.")
    post_timeout_s: float = Field(default=5.0, gt=0, le=9.0, description="Prefect post timeout.")

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


def signature(secret: str, body: bytes) -> str:
    """GitHub's `X-Hub-Signature-256` value for a body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(secret: str, body: bytes, header: str | None) -> bool:
    """True when `header` is the body's HMAC-SHA256 under `secret` (constant-time compare)."""
    if not header:
        return False
    return hmac.compare_digest(signature(secret, body).encode(), header.strip().encode())


class DeliveryCache:
    """Delivery ids seen recently: bounded in size (oldest out first) and in age."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._max = max_entries
        self._ttl = ttl_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._seen)

    def claim(self, delivery: str) -> bool:
        """Record `delivery`; False when it was already recorded (a duplicate)."""
        now = self._clock()
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if now - at < self._ttl:
                break
            del self._seen[oldest]
        if delivery in self._seen:
            return False
        self._seen[delivery] = now
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return True

    def forget(self, delivery: str) -> None:
        self._seen.pop(delivery, None)


class StaleDelivery(InputError):
    """A delivery dated outside the accepted window."""


class BadDelivery(InputError):
    """A signed delivery whose body is not a usable workflow_job payload."""


def _parse_time(value: object, field: str) -> datetime:
    if not isinstance(value, str) or not value:
        raise BadDelivery(f"workflow_job.{field} is missing")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadDelivery(f"workflow_job.{field} {value!r} is not an ISO 8601 time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def delivery_time(payload: Mapping[str, Any]) -> datetime:
    """When the delivery was made, as near as the payload tells: the newest job timestamp.

    The action's own timestamp (ACTION_TIMESTAMP) is usually the newest. Taking the newest of
    all keeps a job that waited (for an approval, say) before it was queued from looking stale.
    """
    job = payload.get("workflow_job")
    if not isinstance(job, Mapping):
        raise BadDelivery("workflow_job is missing")
    action = str(payload.get("action", ""))
    field = ACTION_TIMESTAMP.get(action, "created_at")
    times = [
        _parse_time(job[name], name)
        for name in dict.fromkeys((field, "created_at", "started_at", "completed_at"))
        if job.get(name)
    ]
    if not times:
        raise BadDelivery(f"workflow_job.{field} is missing")
    return max(times)


def check_fresh(payload: Mapping[str, Any], now: datetime, max_age_s: float, skew_s: float) -> None:
    """Raise StaleDelivery when the delivery is older than max_age_s or too far in the future."""
    at = delivery_time(payload)
    age = (now - at).total_seconds()
    if age > max_age_s:
        raise StaleDelivery(f"delivery is {age:.0f} s old (limit {max_age_s:.0f} s)")
    if age < -skew_s:
        raise StaleDelivery(f"delivery is dated {-age:.0f} s in the future")


def repo_resource_id(full_name: str) -> str:
    """`acme/gpu-ci` -> `github.repo.acme.gpu-ci`."""
    owner, _, name = full_name.partition("/")
    return f"github.repo.{owner}.{name}"


def event_for(payload: Mapping[str, Any], delivery: str, received: datetime) -> dict[str, Any]:
    """The Prefect event for one workflow_job delivery (Prefect's event JSON schema)."""
    action = payload.get("action")
    if not isinstance(action, str) or not _ACTION_RE.match(action):
        raise BadDelivery(f"action {action!r} is not a workflow_job action")
    job = payload.get("workflow_job")
    repo = payload.get("repository")
    if not isinstance(job, Mapping) or not isinstance(job.get("id"), int):
        raise BadDelivery("workflow_job.id is missing")
    if not isinstance(repo, Mapping) or not isinstance(repo.get("full_name"), str):
        raise BadDelivery("repository.full_name is missing")
    if not is_repo(repo["full_name"]):
        raise BadDelivery("repository.full_name is not OWNER/NAME")
    full_name: str = repo["full_name"]
    job_id: int = job["id"]
    labels = job.get("labels") or []
    return {
        # derived from the delivery id: a replayed post is the same event to Prefect as well
        "id": str(uuid.uuid5(_NAMESPACE, delivery)),
        "occurred": received.isoformat(),
        "event": f"{EVENT_PREFIX}{action}",
        "resource": {
            "prefect.resource.id": repo_resource_id(full_name),
            "prefect.resource.name": full_name,
            "github.workflow_job.id": str(job_id),
        },
        "related": [
            {
                "prefect.resource.id": f"github.workflow_job.{job_id}",
                "prefect.resource.role": "workflow-job",
                "prefect.resource.name": str(job.get("name") or job_id),
            }
        ],
        "payload": {
            "action": action,
            "delivery": delivery,
            "job_id": job_id,
            "run_id": job.get("run_id"),
            "run_attempt": job.get("run_attempt"),
            "labels": [str(label) for label in labels],
            "status": job.get("status"),
            "conclusion": job.get("conclusion"),
            "runner_name": job.get("runner_name"),
            "repository": full_name,
            "github_timestamp": job.get(ACTION_TIMESTAMP.get(action, "created_at")),
        },
    }


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
    stats: dict[str, int] = {
        "posted": 0,
        "duplicates": 0,
        "unauthorized": 0,
        "stale": 0,
        "ignored": 0,
        "bad": 0,
        "post_failed": 0,
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

    async def hook(request: Request) -> JSONResponse:
        body = await request.body()
        delivery = request.headers.get(DELIVERY_HEADER, "")
        kind = request.headers.get(EVENT_HEADER, "")
        if not verify_signature(secret, body, request.headers.get(SIGNATURE_HEADER)):
            stats["unauthorized"] += 1
            unsigned = SIGNATURE_HEADER not in request.headers
            log.warning(
                "rejected delivery=%s event=%s: %s",
                delivery or "-",
                kind or "-",
                "unsigned" if unsigned else "bad signature",
            )
            return answer(401, "unsigned" if unsigned else "bad-signature")
        if kind == "ping":
            return answer(200, "pong")
        if kind != "workflow_job":
            stats["ignored"] += 1
            return answer(202, "ignored", event=kind)
        if not delivery:
            stats["bad"] += 1
            return answer(400, "bad-delivery", detail="X-GitHub-Delivery header is missing")
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise BadDelivery("the body is not a JSON object")
            received = clock()
            check_fresh(payload, received, settings.max_age_s, settings.max_skew_s)
            event = event_for(payload, delivery, received)
        except StaleDelivery as exc:
            stats["stale"] += 1
            log.warning("rejected delivery=%s: stale: %s", delivery, exc)
            return answer(403, "stale", detail=str(exc))
        except (BadDelivery, ValueError) as exc:
            stats["bad"] += 1
            log.warning("rejected delivery=%s: %s", delivery, exc)
            return answer(400, "bad-delivery", detail=str(exc))
        async with lock:
            fresh = deliveries.claim(delivery)
        if not fresh:
            stats["duplicates"] += 1
            log.info("duplicate delivery=%s ignored", delivery)
            return answer(200, "duplicate", duplicate=True)
        assert poster is not None, "the relay runs inside its lifespan"
        try:
            await poster.post([event])
        except httpx.HTTPError as exc:
            async with lock:
                deliveries.forget(delivery)
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
    return app


class RelayServer(ThreadedServer):
    """The relay under uvicorn on a free loopback port, in a daemon thread (tests, demo, bench)."""

    what = "webhook relay"

    def __init__(self, settings: RelaySettings, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = create_app(settings)
        super().__init__(self.app, host, port)
        self.url = f"{self.base_url}/webhook"

    @property
    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = self.app.state.stats
        return stats
