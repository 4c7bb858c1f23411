"""Async GitHub REST client for runners, labels, runs and jobs: paced, conditional, typed errors.

It also reads what skip-queue authorization needs: a pull request's label events and a team
membership.

Every request carries the token, so what GitHub answers is bounded before it is believed: a
pagination link is followed only to api_url's own scheme, host and port, at most `max_pages`
pages of at most 100 items; a body past `max_body_bytes` (decompressed) is not read on; a body
that is not JSON, or a page of the wrong shape, fails as `MalformedResponse`; redirects are
not followed. Items are checked in `payloads.py`: a malformed one is skipped and warned about
once, and the listing goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from pydantic import SecretStr

from slurmgate.admission.model import Job, JobStatus, Runner
from slurmgate.errors import ExternalError, NotFoundError
from slurmgate.github.app_auth import GitHubAppAuth, GitHubAppCredentials, shared_provider
from slurmgate.github.bodies import ACCEPT_ENCODING, BodyRefused, read_capped
from slurmgate.github.etags import EtagCache, FileEtagCache, MemoryEtagCache
from slurmgate.github.payloads import (
    LabelEvent,
    MalformedPayload,
    ProblemMemory,
    parse_job,
    parse_label_event,
    parse_run_id,
    parse_run_pull_requests,
    parse_runner,
    parse_team_membership,
)
from slurmgate.github.scope import GitHubScope, is_repo
from slurmgate.paths import state_dir

log = logging.getLogger(__name__)

_NEXT_RE = re.compile(r'<([^>]+)>;\s*rel="next"')
_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
PER_PAGE = 100  # GitHub's largest page; a page that holds more items than asked is refused
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest response body read (a page of 100 workflow runs is about 1 MiB)."""
MAX_CACHED_BODY_BYTES = 2 * 1024 * 1024
"""Larger bodies are not kept in the ETag cache, which lives in one file across processes."""
MAX_PAGES = 100
"""Most pages one listing follows: 10,000 runners, runs or jobs."""
REPOS_TTL_S = 60.0
"""How long an all-repos scope's repository list is reused before it is read again."""
MAX_EVENT_PAGES = 10
"""Most pages of one pull request's issue events read: 1,000 events (a PR with more has its
label events refused as unreadable, so it is not authorized to skip the queue)."""

# ---- errors -----------------------------------------------------------------------------------


class GitHubError(ExternalError):
    """A GitHub request that did not succeed. Carries no token and no httpx request object."""

    def __init__(
        self,
        method: str,
        template: str,
        status: int | None,
        message: str,
        *,
        path: str | None = None,
    ) -> None:
        self.method = method
        self.template = template  # what call counters and retry rules key on
        self.path = path or template  # the request as sent, which is what a person can check
        self.status = status
        self.message = message
        super().__init__(
            f"{method} {self.path} -> {status if status is not None else 'no response'}: {message}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Prefect may pickle a failed task's exception; the default would call __init__ with
        # the one formatted message and fail to load it.
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


def _refused_repository(exc: GitHubError) -> bool:
    """A 404, or a 403 that is not a rate limit: GitHub will not show this repository."""
    return isinstance(exc, NotFound) or (isinstance(exc, AuthError) and exc.status == 403)


def _rebuild_error(cls: type[GitHubError], text: str, fields: dict[str, Any]) -> GitHubError:
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    error.__dict__.update(fields)
    return error


class NotFound(GitHubError, NotFoundError):
    """404: the runner, label, run or job does not exist."""


class ValidationFailed(GitHubError):
    """422: GitHub rejected the request body or the operation; retrying cannot help."""


class AuthError(GitHubError):
    """401, or a 403 that is not a rate limit: the token is wrong or lacks a permission.

    `accepted_permissions` is GitHub's `X-Accepted-GitHub-Permissions` on a 403 (the permission
    sets any one of which would do, e.g. `administration=write`), when it is well formed.
    """

    def __init__(
        self,
        method: str,
        template: str,
        status: int | None,
        message: str,
        *,
        path: str | None = None,
        accepted_permissions: str | None = None,
    ) -> None:
        super().__init__(method, template, status, message, path=path)
        self.accepted_permissions = accepted_permissions


_PERMISSION_SETS = re.compile(
    r"[a-z_]{1,64}=(read|write|admin)(\s*[,;]\s*[a-z_]{1,64}=(read|write|admin)){0,15}"
)


def accepted_permissions(headers: httpx.Headers) -> str | None:
    """GitHub's `X-Accepted-GitHub-Permissions`, or None when absent or not of its shape (a
    hostile or broken answer must not put arbitrary text into an error line)."""
    value = headers.get("x-accepted-github-permissions", "").strip()
    return value if len(value) <= 512 and _PERMISSION_SETS.fullmatch(value) else None


class MalformedResponse(GitHubError):
    """A 2xx answer slurmgate refuses: not JSON, too large, the wrong shape, too many pages, or
    a pagination link to another host. Retrying the same request would get the same answer."""


class TransientError(GitHubError):
    """5xx, timeouts and connection errors that outlasted every retry."""

    transient = True


class RateLimited(GitHubError):
    """Primary or secondary rate limit that outlasted every retry; wait `retry_after_s` seconds."""

    transient = True

    def __init__(
        self,
        method: str,
        template: str,
        status: int | None,
        message: str,
        retry_after_s: float,
        *,
        path: str | None = None,
    ) -> None:
        super().__init__(
            method, template, status, f"{message} (retry after {retry_after_s:.1f} s)", path=path
        )
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


@dataclass(frozen=True, slots=True)
class JobSource:
    """Where a listed job came from: its repository, and the pull requests its run is for
    (GitHub's `pull_requests` of the run; empty for a push, or a PR from a fork)."""

    repo: str
    pull_requests: frozenset[int] = frozenset()


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
        token: str | SecretStr | GitHubAppCredentials,
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
        max_body_bytes: int = MAX_BODY_BYTES,
        max_pages: int = MAX_PAGES,
    ) -> None:
        # A GitHub App's installation token comes from the httpx auth plug-in (refreshed
        # before it expires, and once on a 401); a plain token is set on each request here.
        self.app_auth: GitHubAppAuth | None = None
        self._token: SecretStr | None = None
        if isinstance(token, GitHubAppCredentials):
            self.app_auth = GitHubAppAuth(shared_provider(token, scope, transport=transport))
        else:
            secret = token if isinstance(token, SecretStr) else SecretStr(token)
            if not secret.get_secret_value().strip():
                raise ValueError("token is empty; pass a GitHub token (e.g. from GITHUB_TOKEN)")
            self._token = secret
        self.scope = scope
        self.etag_cache: EtagCache = etag_cache if etag_cache is not None else MemoryEtagCache()
        self.min_write_interval_s = min_write_interval_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.secondary_wait_s = secondary_wait_s
        self.max_wait_s = max_wait_s
        self.max_body_bytes = max_body_bytes
        self.max_pages = max_pages
        self.problems = ProblemMemory(self.etag_cache)
        self.unreadable_runners = 0  # runners the last listing left out as malformed
        self.unread_repos: dict[str, str] = {}  # repository -> why the last job read skipped it
        self.calls = CallCounter()
        self._rate_limit: RateLimit | None = None
        self._repos_read: tuple[float, tuple[str, ...]] | None = None
        self._last_write = 0.0
        self._write_lock = asyncio.Lock()
        self._origin = _origin(httpx.URL(scope.api_url))
        self._http = httpx.AsyncClient(
            base_url=scope.api_url,
            follow_redirects=False,  # a redirect must not carry the token to another host
            transport=transport,
            auth=self.app_auth,
            timeout=timeout_s,
            headers={
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": "slurmgate",
                "Accept-Encoding": ACCEPT_ENCODING,
            },
        )

    def __repr__(self) -> str:
        if self.app_auth is not None:
            return f"GitHubClient(scope={self.scope!r}, app_id={self.app_auth.provider.app_id})"
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
        """Every runner of the scope, following Link; conditional=False for verification reads.

        A runner of the wrong shape is left out (warned about once); a page of the wrong shape
        fails the whole listing with MalformedResponse, since a partial fleet is no fleet.
        """
        template = self.scope.runners_template
        pages = await self._paginate(
            template, self.scope.runners_path, {"per_page": PER_PAGE}, conditional
        )
        runners: dict[int, Runner] = {}
        unreadable = 0
        for item in self._items(pages, "runners", template):
            try:
                runner = parse_runner(item)
            except MalformedPayload as exc:
                self._skip(exc)
                unreadable += 1
                continue
            # a runner registered between two page reads shifts the pages: it may show twice
            runners.setdefault(runner.id, runner)
        self.unreadable_runners = unreadable
        return list(runners.values())

    async def get_runner(self, runner_id: int) -> Runner:
        """One runner, read fresh. Raises NotFound when it does not exist."""
        template = self._tpl("/{runner_id}")
        reply = await self._call("GET", template, self._runner_path(runner_id))
        try:
            return parse_runner(reply.body)
        except MalformedPayload as exc:
            raise MalformedResponse("GET", template, reply.status, str(exc)) from None

    async def list_labels(self, runner_id: int) -> list[str]:
        template = self._tpl("/{runner_id}/labels")
        reply = await self._call("GET", template, f"{self._runner_path(runner_id)}/labels")
        names = _label_names(reply.body)
        if names is None:
            raise MalformedResponse("GET", template, reply.status, "labels are not label objects")
        return names

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
        # The write's status code says it landed; its echo of the labels is only informative.
        names = _label_names(reply.body)
        if names is None:
            log.warning("%s labels of runner %s: GitHub echoed no label list", method, runner_id)
        return names or []

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
        template = "/repos/{owner}/{repo}/actions/runs"
        runs: list[dict[str, Any]] = []
        for name in (repo,) if repo else await self.job_repos():
            pages = await self._paginate(
                template,
                f"/repos/{name}/actions/runs",
                {"status": status, "per_page": PER_PAGE},
                True,
            )
            runs.extend(self._items(pages, "workflow_runs", template))
        return runs

    async def list_run_jobs(self, run_id: int, *, repo: str | None = None) -> list[Job]:
        """The latest attempt's jobs of one run (conditional, paginated)."""
        name = repo or self._only_job_repo()
        template = "/repos/{owner}/{repo}/actions/runs/{run_id}/jobs"
        pages = await self._paginate(
            template,
            f"/repos/{name}/actions/runs/{int(run_id)}/jobs",
            {"filter": "latest", "per_page": PER_PAGE},
            True,
        )
        jobs: list[Job] = []
        for item in self._items(pages, "jobs", template):
            try:
                jobs.append(self._job(item))
            except MalformedPayload as exc:
                self._skip(exc)
        return jobs

    async def get_job(self, job_id: int, *, repo: str | None = None) -> Job | None:
        """One job by id, read fresh; None when no scanned repository has it (404).

        Raises MalformedResponse when GitHub answers with something that is not a job: the
        job is then unknown, which is not the same as gone.
        """
        template = "/repos/{owner}/{repo}/actions/jobs/{job_id}"
        refused: AuthError | None = None
        for name in (repo,) if repo else await self.job_repos():
            try:
                reply = await self._call(
                    "GET", template, f"/repos/{name}/actions/jobs/{int(job_id)}"
                )
            except NotFound:
                continue
            except AuthError as exc:
                if repo or not _refused_repository(exc):
                    raise
                refused = refused or exc  # the job may be there: not gone, unknown
                continue
            try:
                return self._job(reply.body)
            except MalformedPayload as exc:
                self._skip(exc)
                raise MalformedResponse("GET", template, reply.status, str(exc)) from None
        if refused is not None:
            raise refused
        return None

    async def get_run_pull_requests(self, run_id: int, *, repo: str) -> frozenset[int]:
        """The pull requests a workflow run is for (conditional); empty for a push or a fork's
        PR. Raises MalformedResponse when the answer is not a run."""
        template = "/repos/{owner}/{repo}/actions/runs/{run_id}"
        reply = await self._call(
            "GET", template, f"/repos/{repo}/actions/runs/{int(run_id)}", conditional=True
        )
        if not isinstance(reply.body, dict):
            raise MalformedResponse("GET", template, reply.status, "the run is not an object")
        return parse_run_pull_requests(reply.body)

    async def list_active_jobs(self) -> list[Job]:
        """Queued and in-progress jobs of every job repo (active runs first, then their jobs).

        A run listing or a run's job listing that GitHub answers with a malformed body is
        skipped with a warning (once) and the others are still read: a job it hid is not
        admitted this tick, and a lease job is still looked up by id by the snapshot.
        """
        jobs, _ = await self.read_active_jobs()
        return jobs

    async def read_active_jobs(self) -> tuple[list[Job], dict[int, JobSource]]:
        """`list_active_jobs`, with where each job came from (its repository and its run's
        pull requests), keyed by job id."""
        jobs: dict[int, Job] = {}
        sources: dict[int, JobSource] = {}
        repos = await self.job_repos()
        self.unread_repos = {}
        for name in repos:
            seen: set[int] = set()
            for status in ("queued", "in_progress"):
                try:
                    runs = await self.list_runs(status, repo=name)
                except MalformedResponse as exc:
                    self.problems.report(f"{status} run listing", name, str(exc), "skipped")
                    continue
                except (NotFound, AuthError) as exc:
                    # One repository of many that cannot be read (renamed, deleted, or not
                    # granted to the App) must not stop the others' admissions; alone, it is
                    # the scope that is wrong, and the tick says so.
                    if len(repos) == 1 or not _refused_repository(exc):
                        raise
                    self.unread_repos[name] = str(exc)
                    for job_id in [i for i, source in sources.items() if source.repo == name]:
                        jobs.pop(job_id, None)  # half a repository is none of it
                        sources.pop(job_id, None)
                    break
                for run in runs:
                    try:
                        run_id = parse_run_id(run)
                    except MalformedPayload as exc:
                        self._skip(exc)
                        continue
                    if run_id in seen:
                        continue
                    seen.add(run_id)
                    try:
                        run_jobs = await self.list_run_jobs(run_id, repo=name)
                    except MalformedResponse as exc:
                        self.problems.report("job listing of run", str(run_id), str(exc), "skipped")
                        continue
                    except NotFound:
                        continue  # the run was deleted since it was listed: no jobs to admit
                    source = JobSource(name, parse_run_pull_requests(run))
                    for job in run_jobs:
                        if job.active:
                            jobs[job.id] = job
                            sources[job.id] = source
        return sorted(jobs.values(), key=lambda j: j.id), sources

    async def job_repos(self) -> tuple[str, ...]:
        """The repositories whose runs and jobs are read: the scope's own, or with `all_repos`
        every repository `GET /orgs/{org}/repos` lists (conditional, so an unchanged list costs
        304s; archived and disabled ones and items of the wrong shape are passed over)."""
        if not self.scope.all_repos:
            return self.scope.job_repos
        if self._repos_read is not None and time.monotonic() - self._repos_read[0] < REPOS_TTL_S:
            return self._repos_read[1]
        template = "/orgs/{org}/repos"
        pages = await self._paginate(
            template, f"/orgs/{self.scope.org}/repos", {"per_page": PER_PAGE}, True
        )
        owner = (self.scope.org or "").casefold()
        names: list[str] = []
        for number, page in enumerate(pages, start=1):
            if not isinstance(page, list) or len(page) > PER_PAGE:
                raise MalformedResponse(
                    "GET", template, 200, f"page {number} is not a list of at most 100 repositories"
                )
            for item in page:
                name = item.get("full_name") if isinstance(item, dict) else None
                if not isinstance(name, str) or not is_repo(name):
                    self.problems.report("repository", str(name)[:100], "no OWNER/NAME", "skipped")
                    continue
                if name.partition("/")[0].casefold() != owner:
                    continue  # another owner's repository is not this scope's
                if item.get("archived") is True or item.get("disabled") is True:
                    continue  # no workflow runs there
                names.append(name)
        found = tuple(dict.fromkeys(names))
        self._repos_read = (time.monotonic(), found)
        return found

    # ---- pull requests and teams (skip-queue authorization) ----

    async def list_label_events(self, repo: str, number: int) -> list[LabelEvent]:
        """The label events of issue or pull request `number` of `repo`, in GitHub's order
        (oldest first); conditional, so an unchanged listing costs one 304 a page.

        Events of other kinds are passed over. Raises NotFound for an issue the token cannot
        see, and MalformedResponse for a page that is not a list, more than MAX_EVENT_PAGES
        pages, or a label event of the wrong shape (it might be the one that decides).
        """
        template = "/repos/{owner}/{repo}/issues/{issue_number}/events"
        pages = await self._paginate(
            template,
            f"/repos/{repo}/issues/{int(number)}/events",
            {"per_page": PER_PAGE},
            True,
            max_pages=MAX_EVENT_PAGES,
        )
        events: list[LabelEvent] = []
        for page_number, page in enumerate(pages, start=1):
            if not isinstance(page, list) or len(page) > PER_PAGE:
                raise MalformedResponse(
                    "GET", template, 200, f"page {page_number} is not a list of at most 100 events"
                )
            for item in page:
                try:
                    event = parse_label_event(item)
                except MalformedPayload as exc:
                    raise MalformedResponse("GET", template, 200, str(exc)) from None
                if event is not None:
                    events.append(event)
        return events

    async def team_member_active(self, org: str, team_slug: str, login: str) -> bool:
        """True when `login` is an active member of the organization's team; False for a
        pending invitation or no membership (404, which is also what a team the token cannot
        see answers)."""
        template = "/orgs/{org}/teams/{team_slug}/memberships/{username}"
        path = "/orgs/{}/teams/{}/memberships/{}".format(
            *(quote(part, safe="") for part in (org, team_slug, login))
        )
        try:
            reply = await self._call("GET", template, path)
        except NotFound:
            return False
        try:
            return parse_team_membership(reply.body)
        except MalformedPayload as exc:
            raise MalformedResponse("GET", template, reply.status, str(exc)) from None

    async def fetch_rate_limit(self) -> RateLimit | None:
        """GET /rate_limit (free of primary quota); updates and returns `rate_limit`."""
        reply = await self._call("GET", "/rate_limit", "/rate_limit")
        body = reply.body if isinstance(reply.body, dict) else {}
        resources = body.get("resources")
        core = (resources.get("core") if isinstance(resources, dict) else None) or body.get("rate")
        if isinstance(core, dict):
            try:
                self._rate_limit = RateLimit(
                    limit=int(core["limit"]),
                    remaining=int(core["remaining"]),
                    reset=int(core["reset"]),
                    used=int(core["used"]),
                    resource="core",
                )
            except (KeyError, TypeError, ValueError):
                raise MalformedResponse(
                    "GET", "/rate_limit", reply.status, "core limits are not integers"
                ) from None
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

    def _job(self, data: Any) -> Job:
        job = parse_job(data)
        if job.status is JobStatus.UNKNOWN:
            self.problems.report(
                "job",
                str(job.id),
                f"status {str(data.get('status'))[:64]!r} is not one slurmgate knows",
                "treated as not active",
            )
        return job

    def _skip(self, exc: MalformedPayload) -> None:
        self.problems.report(exc.kind, exc.item_id, exc.problem, "skipped")

    def _items(self, pages: list[Any], key: str, template: str) -> list[Any]:
        """The items of every page under `key`; a page of another shape fails the listing."""
        items: list[Any] = []
        for number, page in enumerate(pages, start=1):
            found = page.get(key) if isinstance(page, dict) else None
            if not isinstance(found, list):
                got = type(found).__name__ if isinstance(page, dict) else type(page).__name__
                raise MalformedResponse(
                    "GET", template, 200, f"page {number} has no {key!r} list (got {got})"
                )
            if len(found) > PER_PAGE:
                raise MalformedResponse(
                    "GET",
                    template,
                    200,
                    f"page {number} holds {len(found)} {key}, more than the {PER_PAGE} asked for",
                )
            items.extend(found)
        return items

    async def _paginate(
        self,
        template: str,
        path: str,
        params: dict[str, Any],
        conditional: bool,
        *,
        max_pages: int | None = None,
    ) -> list[Any]:
        limit = self.max_pages if max_pages is None else min(max_pages, self.max_pages)
        pages: list[Any] = []
        reply = await self._call("GET", template, path, params=params, conditional=conditional)
        pages.append(reply.body)
        seen: set[str] = set()
        while (next_url := _next_link(reply.headers)) is not None:
            self._check_next(next_url, template, reply.status)
            if next_url in seen:  # a server that links in circles must not hang us
                raise MalformedResponse("GET", template, reply.status, "pagination loops back")
            if len(pages) >= limit:
                raise MalformedResponse(
                    "GET",
                    template,
                    reply.status,
                    f"listing has more than {limit} pages; refusing to read on "
                    "(raise max_pages on the client if the scope really is that large)",
                )
            seen.add(next_url)
            reply = await self._call("GET", template, next_url, conditional=conditional)
            pages.append(reply.body)
        return pages

    def _check_next(self, next_url: str, template: str, status: int) -> None:
        """Follow a `rel="next"` link only to api_url's own scheme, host and port: the request
        carries the token."""
        try:
            target = httpx.URL(next_url)
        except httpx.InvalidURL:
            target = None
        if target is None or target.is_relative_url or _origin(target) != self._origin:
            shown = next_url[:200]
            raise MalformedResponse(
                "GET",
                template,
                status,
                f"pagination link {shown!r} leaves {self.scope.api_url}; not followed",
            )

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
        """One request, with its retries: transport failures and 5xx back off, rate limits wait;
        any other status is a typed error (``_STATUS_ERRORS``)."""
        sent = _sent_path(url)
        cache_key = str(self._http.build_request(method, url, params=params).url)
        conditional = conditional and method == "GET"
        secondary_hits = attempt = 0
        while True:
            cached = self._cached(cache_key) if conditional else None
            got = await self._exchange(method, template, url, params, json_body, cached, attempt)
            if isinstance(got, str):
                # Raised here, outside any `except`, so no httpx exception (which holds the
                # request and its Authorization header) is chained to what the caller sees.
                await self._back_off(method, template, None, got, attempt, sent)
                attempt += 1
                continue
            response, content = got
            status = response.status_code
            if status == 304 and cached is not None:
                self.calls.not_modified[(method, template)] += 1
                return _not_modified(response, cached)
            if isinstance(content, BodyRefused):
                message = f"response body is {content}; refused"
                raise MalformedResponse(method, template, status, message, path=sent)
            if 200 <= status < 300:
                return self._success(method, template, sent, response, content, cache_key)
            message = _error_message(response, content)
            wait = (
                self._rate_limit_wait(response, message, secondary_hits)
                if status in (403, 429)
                else None
            )
            if wait is not None:
                headers = response.headers
                if not headers.get("retry-after") and headers.get("x-ratelimit-remaining") != "0":
                    secondary_hits += 1
                if attempt >= self.max_retries or wait > self.max_wait_s:
                    raise RateLimited(method, template, status, message, wait, path=sent)
                log.warning("%s %s rate limited (%d); waiting %.2f s", method, sent, status, wait)
                attempt += 1
                await asyncio.sleep(wait)
                continue
            if status >= 500:
                await self._back_off(method, template, status, message, attempt, sent)
                attempt += 1
                continue
            raise _status_error(method, template, status, message, sent, response.headers)

    def _cached(self, cache_key: str) -> tuple[str, dict[str, Any]] | None:
        """The ETag cache's entry for a conditional GET, when it is in the current format."""
        cached = self.etag_cache.get(cache_key)
        if cached is None or not (isinstance(cached[1], dict) and "body" in cached[1]):
            return None  # none, or an entry in an older or foreign format: read afresh
        return cached

    async def _exchange(
        self,
        method: str,
        template: str,
        url: str,
        params: dict[str, Any] | None,
        json_body: Any,
        cached: tuple[str, dict[str, Any]] | None,
        attempt: int,
    ) -> tuple[httpx.Response, bytes | BodyRefused] | str:
        """The transport: send once (paced, counted, conditional) and read the body capped.
        Returns the response and its body (or why the body was refused), or the name of the
        transport failure."""
        headers = (
            {"Authorization": f"Bearer {self._token.get_secret_value()}"}
            if self._token is not None
            else {}
        )
        if cached is not None:
            headers["If-None-Match"] = cached[0]
        if method in _WRITE_METHODS:
            await self._pace_write()
        self.calls.requests[(method, template)] += 1
        if attempt:
            self.calls.retries += 1
        response = await self._send(method, url, params, json_body, headers)
        if isinstance(response, str):
            return response
        content = await self._read_capped(response)
        if isinstance(content, str):
            return content
        self._note_rate_limit(response.headers)
        log.debug("%s %s -> %d", method, template, response.status_code)
        return response, content

    def _success(
        self,
        method: str,
        template: str,
        sent: str,
        response: httpx.Response,
        content: bytes,
        cache_key: str,
    ) -> _Reply:
        body = _json_body(content, method, template, response.status_code, sent)
        etag = response.headers.get("etag")
        if method == "GET" and etag and len(content) <= MAX_CACHED_BODY_BYTES:
            entry = {"body": body, "link": response.headers.get("link", "")}
            self.etag_cache.put(cache_key, etag, entry)
        return _Reply(response.status_code, body, response.headers)

    async def _send(
        self,
        method: str,
        url: str,
        params: dict[str, Any] | None,
        json_body: Any,
        headers: dict[str, str],
    ) -> httpx.Response | str:
        """The response, headers only (read the body with `_read_capped`), or the name of the
        transport failure (timeout, refused, reset)."""
        try:
            request = self._http.build_request(
                method, url, params=params, json=json_body, headers=headers
            )
            return await self._http.send(request, stream=True)
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            return type(exc).__name__

    async def _read_capped(self, response: httpx.Response) -> bytes | BodyRefused | str:
        """The decoded body (identity or one gzip, at most `max_body_bytes` as it streams), why
        it was refused, or the name of the failure that cut it short; closes the response."""
        try:
            return await read_capped(response, self.max_body_bytes)
        except BodyRefused as refused:
            return refused
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            return type(exc).__name__

    def _rate_limit_wait(
        self, response: httpx.Response, message: str, secondary_hits: int
    ) -> float | None:
        """Seconds to wait for a rate-limited 403/429, or None when it is not a rate limit."""
        headers = response.headers
        retry_after = headers.get("retry-after")
        if retry_after is not None:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = math.nan
            if math.isfinite(seconds):
                return max(0.0, seconds)
            if seconds == math.inf:
                return seconds
        if headers.get("x-ratelimit-remaining") == "0":
            try:
                reset = float(headers["x-ratelimit-reset"])
            except (KeyError, ValueError):
                return self.secondary_wait_s
            if not math.isfinite(reset):
                return self.secondary_wait_s
            return max(0.0, reset - time.time()) + 0.05
        if response.status_code == 429 or "rate limit" in message.lower():
            return float(min(self.secondary_wait_s * (2**secondary_hits), self.max_wait_s + 1.0))
        return None

    async def _back_off(
        self,
        method: str,
        template: str,
        status: int | None,
        failure: str,
        attempt: int,
        sent: str,
    ) -> None:
        """Wait before retrying a transient failure, or raise once the retries are spent."""
        if attempt >= self.max_retries:
            raise TransientError(
                method, template, status, f"{failure} after {attempt + 1} attempts", path=sent
            )
        delay = self._backoff(attempt)
        answer = f" -> {status}" if status is not None else f": {failure}"
        log.info("%s %s%s; retry in %.2f s", method, sent, answer, delay)
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


# What a status no retry helps means, as an error; a 403 here is not a rate limit. Any other
# status is a plain GitHubError.
_STATUS_ERRORS: dict[int, type[GitHubError]] = {
    401: AuthError,
    403: AuthError,
    404: NotFound,
    422: ValidationFailed,
}


def _status_error(
    method: str, template: str, status: int, message: str, sent: str, headers: httpx.Headers
) -> GitHubError:
    kind = _STATUS_ERRORS.get(status, GitHubError)
    if status == 403:
        permissions = accepted_permissions(headers)
        return AuthError(
            method, template, status, message, path=sent, accepted_permissions=permissions
        )
    return kind(method, template, status, message, path=sent)


def _not_modified(response: httpx.Response, cached: tuple[str, dict[str, Any]]) -> _Reply:
    """A 304's reply from the cache. A 304 may omit Link; the cached entry keeps the page's."""
    reply_headers = httpx.Headers(response.headers)
    if cached[1].get("link") and "link" not in reply_headers:
        reply_headers["link"] = cached[1]["link"]
    return _Reply(304, cached[1].get("body"), reply_headers, not_modified=True)


def _label_names(body: Any) -> list[str] | None:
    """The label names of a labels answer, or None when it is not a list of label objects."""
    labels = body.get("labels") if isinstance(body, dict) else None
    if not isinstance(labels, list):
        return None
    names = [label.get("name") if isinstance(label, dict) else None for label in labels]
    return (
        [name for name in names if isinstance(name, str)]
        if all(isinstance(name, str) for name in names)
        else None
    )


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    default = {"http": 80, "https": 443}.get(url.scheme)
    return (url.scheme, url.host, url.port or default)


def _json_body(content: bytes, method: str, template: str, status: int, sent: str) -> Any:
    if not content:
        return None
    try:
        return json.loads(content)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        raise MalformedResponse(
            method, template, status, "response body is not JSON", path=sent
        ) from None


def _sent_path(url: str) -> str:
    """The path of a request as sent (a next link is a whole URL), without its query."""
    return urlsplit(url).path or url


def _next_link(headers: httpx.Headers) -> str | None:
    match = _NEXT_RE.search(headers.get("link", ""))
    return match.group(1) if match else None


def _error_message(response: httpx.Response, content: bytes) -> str:
    """GitHub's `message` (and `errors`), at most 500 printable characters: it ends up in a
    one-line error, and a hostile answer must not break the line or drive the terminal."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return _printable(response.reason_phrase or "error")
    if isinstance(body, dict):
        message = str(body.get("message") or response.reason_phrase or "error")
        errors = body.get("errors")
        if errors:
            message += f" ({'; '.join(str(e) for e in errors)[:300]})"
        return _printable(message[:500])
    return _printable(response.reason_phrase or "error")


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text)


def etag_cache_for(scope: GitHubScope) -> FileEtagCache:
    """One ETag cache file per API and scope, so 304s survive across flow runs and processes."""
    key = hashlib.sha256(f"{scope.api_url}|{scope.repo}|{scope.org}".encode()).hexdigest()[:16]
    return FileEtagCache(state_dir() / f"etags-{key}.json")


def client_for_scope(
    scope: GitHubScope, token: str | SecretStr | GitHubAppCredentials, **options: Any
) -> GitHubClient:
    """A client for `scope` with its file ETag cache (kept across processes); `options` go to
    GitHubClient, e.g. min_write_interval_s and max_retries."""
    options.setdefault("etag_cache", etag_cache_for(scope))
    return GitHubClient(scope, token, **options)
