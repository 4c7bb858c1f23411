"""The request path to GitHub's REST API: auth, pacing, retries, conditional reads, bounded pages.

`GitHubSession` sends one request at a time as GitHub's client rules ask and believes nothing
it is answered before it is bounded: a pagination link is followed only to api_url's own
scheme, host and port, at most `max_pages` pages of at most 100 items; a body past
`max_body_bytes` (decompressed) is not read on; a body that is not JSON, or a page of the wrong
shape, fails as `MalformedResponse`; redirects are not followed, since every request carries
the token. `GitHubClient` adds the endpoints on top.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from slurmgate.github.app_auth import GitHubAppAuth, GitHubAppCredentials, shared_provider
from slurmgate.github.bodies import ACCEPT_ENCODING, BodyRefused, read_capped
from slurmgate.github.conditional import CachedReply, Reply, cached_reply, not_modified, remember
from slurmgate.github.errors import (
    MalformedResponse,
    RateLimited,
    TransientError,
    error_message,
    status_error,
)
from slurmgate.github.etags import EtagCache, MemoryEtagCache
from slurmgate.github.pacing import (
    WRITE_METHODS,
    CallCounter,
    RateLimit,
    WriteSpacing,
    backoff_delay,
    rate_limit_wait,
    read_rate_limit,
)
from slurmgate.github.payloads import ProblemMemory
from slurmgate.github.scope import GitHubScope

log = logging.getLogger(__name__)

_NEXT_RE = re.compile(r'<([^>]+)>;\s*rel="next"')
PER_PAGE = 100  # GitHub's largest page; a page that holds more items than asked is refused
MAX_BODY_BYTES = 16 * 1024 * 1024
"""Largest response body read (a page of 100 workflow runs is about 1 MiB)."""
MAX_PAGES = 100
"""Most pages one listing follows: 10,000 runners, runs or jobs."""


class GitHubSession:
    """One scope's connection to GitHub: sends requests, counts them, keeps the ETag cache."""

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
        self.calls = CallCounter()
        # What the endpoints (GitHubClient) remember between reads: each skipped item's one
        # warning, what the last reads left out, and an all-repos scope's repository list.
        self.problems = ProblemMemory(self.etag_cache)
        self.unreadable_runners = 0  # runners the last listing left out as malformed
        self.unread_repos: dict[str, str] = {}  # repository -> why the last job read skipped it
        self._repos_read: tuple[float, tuple[str, ...]] | None = None
        self._rate_limit: RateLimit | None = None
        self._write_spacing = WriteSpacing()
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
        name = type(self).__name__
        if self.app_auth is not None:
            return f"{name}(scope={self.scope!r}, app_id={self.app_auth.provider.app_id})"
        return f"{name}(scope={self.scope!r}, token=SecretStr('**********'))"

    __str__ = __repr__

    async def __aenter__(self) -> Self:
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
    ) -> Reply:
        """One request, with its retries: transport failures and 5xx back off, rate limits wait;
        any other status is a typed error (``errors.STATUS_ERRORS``)."""
        sent = _sent_path(url)
        cache_key = str(self._http.build_request(method, url, params=params).url)
        conditional = conditional and method == "GET"
        secondary_hits = attempt = 0
        while True:
            cached = cached_reply(self.etag_cache, cache_key) if conditional else None
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
                return not_modified(response, cached)
            if isinstance(content, BodyRefused):
                message = f"response body is {content}; refused"
                raise MalformedResponse(method, template, status, message, path=sent)
            if 200 <= status < 300:
                return self._success(method, template, sent, response, content, cache_key)
            message = error_message(response, content)
            wait = (
                rate_limit_wait(
                    response,
                    message,
                    secondary_hits,
                    secondary_wait_s=self.secondary_wait_s,
                    max_wait_s=self.max_wait_s,
                )
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
            raise status_error(method, template, status, message, sent, response.headers)

    async def _exchange(
        self,
        method: str,
        template: str,
        url: str,
        params: dict[str, Any] | None,
        json_body: Any,
        cached: CachedReply | None,
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
        if method in WRITE_METHODS:
            await self._write_spacing.wait(self.min_write_interval_s)
        self.calls.requests[(method, template)] += 1
        if attempt:
            self.calls.retries += 1
        response = await self._send(method, url, params, json_body, headers)
        if isinstance(response, str):
            return response
        content = await self._read_capped(response)
        if isinstance(content, str):
            return content
        if (rate_limit := read_rate_limit(response.headers)) is not None:
            self._rate_limit = rate_limit
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
    ) -> Reply:
        body = _json_body(content, method, template, response.status_code, sent)
        if method == "GET":
            remember(self.etag_cache, cache_key, response, body, len(content))
        return Reply(response.status_code, body, response.headers)

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
        delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_cap_s)
        answer = f" -> {status}" if status is not None else f": {failure}"
        log.info("%s %s%s; retry in %.2f s", method, sent, answer, delay)
        await asyncio.sleep(delay)


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
