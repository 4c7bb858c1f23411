"""Conditional reads: the cached body behind an ETag, a 304 answered from it, what is kept.

A GET sends `If-None-Match` with the ETag of the body it last read at that URL; GitHub answers
304 without a body (and without drawing on the primary quota), and the reply is rebuilt from
the cache. Entries are keyed by the full URL with its query, and a body is kept with its page's
`Link`, which a 304 may leave out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from slurmgate.github.etags import EtagCache

MAX_CACHED_BODY_BYTES = 2 * 1024 * 1024
"""Larger bodies are not kept in the ETag cache, which lives in one file across processes."""

CachedReply = tuple[str, dict[str, Any]]
"""An ETag and its entry: the JSON body and the page's `Link`."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A successful answer: its status, JSON body and headers; `not_modified` for a 304."""

    status: int
    body: Any
    headers: httpx.Headers
    not_modified: bool = False


def cached_reply(cache: EtagCache, key: str) -> CachedReply | None:
    """The ETag cache's entry for a conditional GET, when it is in the current format."""
    cached = cache.get(key)
    if cached is None or not (isinstance(cached[1], dict) and "body" in cached[1]):
        return None  # none, or an entry in an older or foreign format: read afresh
    return cached


def not_modified(response: httpx.Response, cached: CachedReply) -> Reply:
    """A 304's reply from the cache. A 304 may omit Link; the cached entry keeps the page's."""
    reply_headers = httpx.Headers(response.headers)
    if cached[1].get("link") and "link" not in reply_headers:
        reply_headers["link"] = cached[1]["link"]
    return Reply(304, cached[1].get("body"), reply_headers, not_modified=True)


def remember(cache: EtagCache, key: str, response: httpx.Response, body: Any, size: int) -> None:
    """Keep a GET's body (`size` bytes as read) under its ETag, when it has one and fits."""
    etag = response.headers.get("etag")
    if etag and size <= MAX_CACHED_BODY_BYTES:
        cache.put(key, etag, {"body": body, "link": response.headers.get("link", "")})
