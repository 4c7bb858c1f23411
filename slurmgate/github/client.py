"""Async GitHub REST client for runners, labels, runs and jobs: paced, conditional, typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import SecretStr

from slurmgate.admission.model import Job, JobStatus, Runner
from slurmgate.errors import ExternalError, NotFoundError
from slurmgate.github.etags import EtagCache, FileEtagCache, MemoryEtagCache
from slurmgate.github.scope import GitHubScope

log = logging.getLogger(__name__)

_NEXT_RE = re.compile(r'<([^>]+)>;\s*rel="next"')
_NOT_STARTED = (JobStatus.QUEUED, JobStatus.WAITING, JobStatus.REQUESTED, JobStatus.PENDING)
_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

# ---- errors -----------------------------------------------------------------------------------


class GitHubError(ExternalError):
    """A GitHub request that did not succeed. Carries no token and no httpx request object."""

    def __init__(self, method: str, path: str, status: int | None, message: str) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.message = message
        super().__init__(
            f"{method} {path} -> {status if status is not None else 'no response'}: {message}"
        )


class NotFound(GitHubError, NotFoundError):
    """404: the runner, label, run or job does not exist."""


class ValidationFailed(GitHubError):
    """422: GitHub rejected the request body or the operation; retrying cannot help."""


class AuthError(GitHubError):
    """401, or a 403 that is not a rate limit: the token is wrong or lacks a permission."""


class TransientError(GitHubError):
    """5xx, timeouts and connection errors that outlasted every retry."""

    transient = True


class RateLimited(GitHubError):
    """Primary or secondary rate limit that outlasted every retry; wait `retry_after_s` seconds."""

    transient = True

    def __init__(
        self, method: str, path: str, status: int | None, message: str, retry_after_s: float
    ) -> None:
        super().__init__(method, path, status, f"{message} (retry after {retry_after_s:.1f} s)")
        self.retry_after_s = retry_after_s


# ---- rate limit and counters ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RateLimit:
    """The last `x-ratelimit-*` headers seen."""

    limit: int
    remaining: int
    reset: int
    used: int
    resource: str


@dataclass
class CallCounter:
    """Requests sent, by (method, path template); how many were 304s; how many were retries."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    not_modified: Counter[tuple[str, str]] = field(default_factory=Counter)
    retries: int = 0

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def total_not_modified(self) -> int:
        return sum(self.not_modified.values())

    @property
    def writes(self) -> int:
        return sum(n for (method, _), n in self.requests.items() if method in _WRITE_METHODS)

    def reset(self) -> None:
        self.requests.clear()
        self.not_modified.clear()
        self.retries = 0


# ---- parsing ----------------------------------------------------------------------------------


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def parse_runner(data: dict[str, Any]) -> Runner:
    """A `runner` object as GitHub returns it, as a model Runner."""
    labels = data.get("labels") or []
    return Runner(
        id=int(data["id"]),
        name=str(data["name"]),
        online=data.get("status") == "online",
        busy=bool(data.get("busy")),
        labels=tuple(str(label["name"]) for label in labels),
        read_only=frozenset(str(lb["name"]) for lb in labels if lb.get("type") == "read-only"),
    )


def parse_job(data: dict[str, Any]) -> Job:
    """A `job` object as a model Job; started_at of a job that has not started is dropped."""
    status = JobStatus(data["status"])
    created = _time(data.get("created_at")) or _time(data.get("started_at"))
    if created is None:
        raise ValueError(f"job {data.get('id')} has neither created_at nor started_at")
    return Job(
        id=int(data["id"]),
        run_id=int(data["run_id"]),
        run_attempt=int(data.get("run_attempt") or 1),
        name=str(data.get("name") or ""),
        labels=tuple(str(label) for label in data.get("labels") or ()),
        status=status,
        created_at=created,
        conclusion=data.get("conclusion"),
        runner_id=data.get("runner_id"),
        runner_name=data.get("runner_name"),
        started_at=None if status in _NOT_STARTED else _time(data.get("started_at")),
        completed_at=_time(data.get("completed_at")),
    )


# ---- client -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: Any
    headers: httpx.Headers
    not_modified: bool = False


class GitHubClient:
    """Talks to GitHub for one scope. Use `async with GitHubClient(...) as gh:` or call aclose()."""

    def __init__(
        self,
        scope: GitHubScope,
        token: str | SecretStr,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        etag_cache: EtagCache | None = None,
        min_write_interval_s: float = 0.0,
        max_retries: int = 4,
        timeout_s: float = 10.0,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 8.0,
        secondary_wait_s: float = 60.0,
        max_wait_s: float = 900.0,
    ) -> None:
        secret = token if isinstance(token, SecretStr) else SecretStr(token)
        if not secret.get_secret_value().strip():
            raise ValueError("token is empty; pass a GitHub token (e.g. from GITHUB_TOKEN)")
        self.scope = scope
        self._token = secret
        self.etag_cache: EtagCache = etag_cache if etag_cache is not None else MemoryEtagCache()
        self.min_write_interval_s = min_write_interval_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.secondary_wait_s = secondary_wait_s
        self.max_wait_s = max_wait_s
        self.calls = CallCounter()
        self._rate_limit: RateLimit | None = None
        self._last_write = 0.0
        self._write_lock = asyncio.Lock()
        self._http = httpx.AsyncClient(
            base_url=scope.api_url,
            transport=transport,
            timeout=timeout_s,
            headers={
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": "slurmgate",
            },
        )

    def __repr__(self) -> str:
        return f"GitHubClient(scope={self.scope!r}, token=SecretStr('**********'))"

    __str__ = __repr__

    async def __aenter__(self) -> GitHubClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool and write the ETag cache out."""
        try:
            self.etag_cache.flush()
        except OSError as exc:  # a cache that cannot be written only costs quota later
            log.warning("could not write the ETag cache: %s", exc)
        await self._http.aclose()

    @property
    def rate_limit(self) -> RateLimit | None:
        return self._rate_limit

    # ---- runners and labels ----

    async def list_runners(self, conditional: bool = True) -> list[Runner]:
        """Every runner of the scope, following Link; conditional=False for verification reads."""
        pages = await self._paginate(
            self.scope.runners_template, self.scope.runners_path, {"per_page": 100}, conditional
        )
        return [parse_runner(item) for page in pages for item in page.get("runners", [])]

    async def get_runner(self, runner_id: int) -> Runner:
        """One runner, read fresh. Raises NotFound when it does not exist."""
        reply = await self._call("GET", self._tpl("/{runner_id}"), self._runner_path(runner_id))
        return parse_runner(reply.body)

    async def list_labels(self, runner_id: int) -> list[str]:
        reply = await self._call(
            "GET", self._tpl("/{runner_id}/labels"), f"{self._runner_path(runner_id)}/labels"
        )
        return _label_names(reply.body)

    async def add_labels(self, runner_id: int, labels: list[str] | tuple[str, ...]) -> list[str]:
        """POST custom labels (1..100); returns the runner's full label list afterwards."""
        return await self._write_labels("POST", runner_id, labels)

    async def set_labels(self, runner_id: int, labels: list[str] | tuple[str, ...]) -> list[str]:
        """PUT: replace every custom label (0..100); returns the full label list afterwards."""
        return await self._write_labels("PUT", runner_id, labels)

    async def _write_labels(
        self, method: str, runner_id: int, labels: list[str] | tuple[str, ...]
    ) -> list[str]:
        path = f"{self._runner_path(runner_id)}/labels"
        body = {"labels": list(labels)}
        reply = await self._call(method, self._tpl("/{runner_id}/labels"), path, json_body=body)
        return _label_names(reply.body)

    async def remove_label(self, runner_id: int, label: str) -> bool:
        """DELETE one custom label. False when GitHub answers 404 (already absent): idempotent."""
        try:
            await self._call(
                "DELETE",
                self._tpl("/{runner_id}/labels/{name}"),
                f"{self._runner_path(runner_id)}/labels/{quote(label, safe='')}",
            )
        except NotFound:
            return False
        return True

    # ---- runs and jobs ----

    async def list_runs(self, status: str, *, repo: str | None = None) -> list[dict[str, Any]]:
        """Workflow runs with `status` (queued / in_progress) of one repo, or of every job repo."""
        runs: list[dict[str, Any]] = []
        for name in (repo,) if repo else self.scope.job_repos:
            pages = await self._paginate(
                "/repos/{owner}/{repo}/actions/runs",
                f"/repos/{name}/actions/runs",
                {"status": status, "per_page": 100},
                True,
            )
            runs.extend(run for page in pages for run in page.get("workflow_runs", []))
        return runs

    async def list_run_jobs(self, run_id: int, *, repo: str | None = None) -> list[Job]:
        """The latest attempt's jobs of one run (conditional, paginated)."""
        name = repo or self._only_job_repo()
        pages = await self._paginate(
            "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs",
            f"/repos/{name}/actions/runs/{int(run_id)}/jobs",
            {"filter": "latest", "per_page": 100},
            True,
        )
        return [parse_job(item) for page in pages for item in page.get("jobs", [])]

    async def get_job(self, job_id: int, *, repo: str | None = None) -> Job | None:
        """One job by id, read fresh; None when no scanned repository has it (404)."""
        for name in (repo,) if repo else self.scope.job_repos:
            try:
                reply = await self._call(
                    "GET",
                    "/repos/{owner}/{repo}/actions/jobs/{job_id}",
                    f"/repos/{name}/actions/jobs/{int(job_id)}",
                )
            except NotFound:
                continue
            return parse_job(reply.body)
        return None

    async def list_active_jobs(self) -> list[Job]:
        """Queued and in-progress jobs of every job repo (active runs first, then their jobs)."""
        jobs: dict[int, Job] = {}
        for name in self.scope.job_repos:
            seen: set[int] = set()
            for status in ("queued", "in_progress"):
                for run in await self.list_runs(status, repo=name):
                    run_id = int(run["id"])
                    if run_id in seen:
                        continue
                    seen.add(run_id)
                    for job in await self.list_run_jobs(run_id, repo=name):
                        if job.active:
                            jobs[job.id] = job
        return sorted(jobs.values(), key=lambda j: j.id)

    async def fetch_rate_limit(self) -> RateLimit | None:
        """GET /rate_limit (free of primary quota); updates and returns `rate_limit`."""
        reply = await self._call("GET", "/rate_limit", "/rate_limit")
        core = (reply.body.get("resources") or {}).get("core") or reply.body.get("rate")
        if isinstance(core, dict):
            self._rate_limit = RateLimit(
                limit=int(core["limit"]),
                remaining=int(core["remaining"]),
                reset=int(core["reset"]),
                used=int(core["used"]),
                resource="core",
            )
        return self._rate_limit

    # ---- plumbing ----

    def _tpl(self, suffix: str) -> str:
        return self.scope.runners_template + suffix

    def _runner_path(self, runner_id: int) -> str:
        return f"{self.scope.runners_path}/{int(runner_id)}"

    def _only_job_repo(self) -> str:
        repos = self.scope.job_repos
        if len(repos) != 1:
            raise ValueError(
                f"scope has {len(repos)} job repositories; pass repo=OWNER/NAME to pick one"
            )
        return repos[0]

    async def _paginate(
        self, template: str, path: str, params: dict[str, Any], conditional: bool
    ) -> list[Any]:
        pages: list[Any] = []
        reply = await self._call("GET", template, path, params=params, conditional=conditional)
        pages.append(reply.body)
        seen: set[str] = set()
        while (next_url := _next_link(reply.headers)) is not None:
            if next_url in seen:  # a server that links in circles must not hang us
                raise GitHubError("GET", template, reply.status, "pagination Link loops back")
            seen.add(next_url)
            reply = await self._call("GET", template, next_url, conditional=conditional)
            pages.append(reply.body)
        return pages

    async def _call(
        self,
        method: str,
        template: str,
        url: str,
        *,
        params: dict[str, Any] | None = None,
        json_body: Any = None,
        conditional: bool = False,
    ) -> _Reply:
        write = method in _WRITE_METHODS
        cacheable = method == "GET"
        cache_key = str(self._http.build_request(method, url, params=params).url)
        secondary_hits = 0
        attempt = 0
        while True:
            headers = {"Authorization": f"Bearer {self._token.get_secret_value()}"}
            cached = self.etag_cache.get(cache_key) if cacheable and conditional else None
            if cached is not None and not (isinstance(cached[1], dict) and "body" in cached[1]):
                cached = None  # an entry in an older or foreign format: read afresh
            if cached is not None:
                headers["If-None-Match"] = cached[0]
            if write:
                await self._pace_write()
            self.calls.requests[(method, template)] += 1
            if attempt:
                self.calls.retries += 1
            failure = await self._send(method, url, params, json_body, headers)
            if isinstance(failure, str):
                # Raised here, outside any `except`, so no httpx exception (which holds the
                # request and its Authorization header) is chained to what the caller sees.
                await self._back_off(method, template, None, failure, attempt)
                attempt += 1
                continue
            response = failure
            self._note_rate_limit(response.headers)
            status = response.status_code
            log.debug("%s %s -> %d", method, template, status)
            if status == 304 and cached is not None:
                self.calls.not_modified[(method, template)] += 1
                # A 304 may omit Link; the cached entry keeps the page's own Link header.
                reply_headers = httpx.Headers(response.headers)
                if cached[1].get("link") and "link" not in reply_headers:
                    reply_headers["link"] = cached[1]["link"]
                return _Reply(status, cached[1].get("body"), reply_headers, not_modified=True)
            if 200 <= status < 300:
                body = response.json() if response.content else None
                etag = response.headers.get("etag")
                if cacheable and etag:
                    entry = {"body": body, "link": response.headers.get("link", "")}
                    self.etag_cache.put(cache_key, etag, entry)
                return _Reply(status, body, response.headers)
            message = _error_message(response)
            if status in (403, 429):
                wait = self._rate_limit_wait(response, secondary_hits)
                if wait is not None:
                    if (
                        not response.headers.get("retry-after")
                        and response.headers.get("x-ratelimit-remaining") != "0"
                    ):
                        secondary_hits += 1
                    if attempt >= self.max_retries or wait > self.max_wait_s:
                        raise RateLimited(method, template, status, message, wait)
                    log.warning(
                        "%s %s rate limited (%d); waiting %.2f s", method, template, status, wait
                    )
                    attempt += 1
                    await asyncio.sleep(wait)
                    continue
                raise AuthError(method, template, status, message)
            if status >= 500:
                await self._back_off(method, template, status, message, attempt)
                attempt += 1
                continue
            if status == 404:
                raise NotFound(method, template, status, message)
            if status == 422:
                raise ValidationFailed(method, template, status, message)
            if status == 401:
                raise AuthError(method, template, status, message)
            raise GitHubError(method, template, status, message)

    async def _send(
        self,
        method: str,
        url: str,
        params: dict[str, Any] | None,
        json_body: Any,
        headers: dict[str, str],
    ) -> httpx.Response | str:
        """The response, or the name of the transport failure (timeout, refused, reset)."""
        try:
            return await self._http.request(
                method, url, params=params, json=json_body, headers=headers
            )
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            return type(exc).__name__

    def _rate_limit_wait(self, response: httpx.Response, secondary_hits: int) -> float | None:
        """Seconds to wait for a rate-limited 403/429, or None when it is not a rate limit."""
        headers = response.headers
        retry_after = headers.get("retry-after")
        if retry_after is not None:
            try:
                return max(0.0, float(retry_after))
            except ValueError:
                pass
        if headers.get("x-ratelimit-remaining") == "0":
            try:
                return max(0.0, float(headers["x-ratelimit-reset"]) - time.time()) + 0.05
            except (KeyError, ValueError):
                return self.secondary_wait_s
        if response.status_code == 429 or "rate limit" in _error_message(response).lower():
            return float(min(self.secondary_wait_s * (2**secondary_hits), self.max_wait_s + 1.0))
        return None

    async def _back_off(
        self, method: str, template: str, status: int | None, failure: str, attempt: int
    ) -> None:
        """Wait before retrying a transient failure, or raise once the retries are spent."""
        if attempt >= self.max_retries:
            raise TransientError(
                method, template, status, f"{failure} after {attempt + 1} attempts"
            )
        delay = self._backoff(attempt)
        answer = f" -> {status}" if status is not None else f": {failure}"
        log.info("%s %s%s; retry in %.2f s", method, template, answer, delay)
        await asyncio.sleep(delay)

    def _backoff(self, attempt: int) -> float:
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * (2**attempt))
        return float(ceiling / 2 + random.uniform(0, ceiling / 2))

    async def _pace_write(self) -> None:
        if self.min_write_interval_s <= 0:
            return
        async with self._write_lock:
            wait = self._last_write + self.min_write_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_write = time.monotonic()

    def _note_rate_limit(self, headers: httpx.Headers) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._rate_limit = RateLimit(
                limit=int(headers["x-ratelimit-limit"]),
                remaining=int(headers["x-ratelimit-remaining"]),
                reset=int(headers["x-ratelimit-reset"]),
                used=int(headers.get("x-ratelimit-used", "0")),
                resource=headers.get("x-ratelimit-resource", "core"),
            )


def _label_names(body: Any) -> list[str]:
    return [str(label["name"]) for label in (body or {}).get("labels", [])]


def _next_link(headers: httpx.Headers) -> str | None:
    match = _NEXT_RE.search(headers.get("link", ""))
    return match.group(1) if match else None


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.reason_phrase or "error"
    if isinstance(body, dict):
        message = str(body.get("message") or response.reason_phrase or "error")
        errors = body.get("errors")
        if errors:
            message += f" ({'; '.join(str(e) for e in errors)[:300]})"
        return message[:500]
    return response.reason_phrase or "error"


STATE_DIR_ENV = "SLURMGATE_STATE_DIR"


def state_dir() -> Path:
    """Where the controller keeps its ETag cache: $SLURMGATE_STATE_DIR, else ~/.cache/slurmgate."""
    configured = os.environ.get(STATE_DIR_ENV, "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "slurmgate"


def etag_cache_for(scope: GitHubScope) -> FileEtagCache:
    """One ETag cache file per API and scope, so 304s survive across flow runs and processes."""
    key = hashlib.sha256(f"{scope.api_url}|{scope.repo}|{scope.org}".encode()).hexdigest()[:16]
    return FileEtagCache(state_dir() / f"etags-{key}.json")


def client_for_scope(scope: GitHubScope, token: str | SecretStr, **options: Any) -> GitHubClient:
    """A client for `scope` with its file ETag cache (kept across processes); `options` go to
    GitHubClient, e.g. min_write_interval_s and max_retries."""
    options.setdefault("etag_cache", etag_cache_for(scope))
    return GitHubClient(scope, token, **options)
