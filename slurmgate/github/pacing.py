"""Pacing of GitHub requests: rate-limit waits, retry backoff, write spacing, call counters.

GitHub's documented client rules: wait out `Retry-After`, or until `x-ratelimit-reset` when
the primary quota is spent; back off exponentially on a secondary limit without either; space
out writes (content-creating requests draw on the secondary limits); retry 5xx and transport
failures with jittered exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True, slots=True)
class RateLimit:
    """The last `x-ratelimit-*` headers seen."""

    limit: int
    remaining: int
    reset: int
    used: int
    resource: str


def read_rate_limit(headers: httpx.Headers) -> RateLimit | None:
    """The `x-ratelimit-*` headers of an answer, or None when any of them is absent or bad."""
    with contextlib.suppress(KeyError, ValueError):
        return RateLimit(
            limit=int(headers["x-ratelimit-limit"]),
            remaining=int(headers["x-ratelimit-remaining"]),
            reset=int(headers["x-ratelimit-reset"]),
            used=int(headers.get("x-ratelimit-used", "0")),
            resource=headers.get("x-ratelimit-resource", "core"),
        )
    return None


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
        return sum(n for (method, _), n in self.requests.items() if method in WRITE_METHODS)

    def reset(self) -> None:
        self.requests.clear()
        self.not_modified.clear()
        self.retries = 0


def rate_limit_wait(
    response: httpx.Response,
    message: str,
    secondary_hits: int,
    *,
    secondary_wait_s: float,
    max_wait_s: float,
) -> float | None:
    """Seconds to wait for a rate-limited 403/429, or None when it is not a rate limit.

    `secondary_hits` counts the secondary limits met so far without a `Retry-After`: each one
    doubles the wait from `secondary_wait_s`, up to just past `max_wait_s`.
    """
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
            return secondary_wait_s
        if not math.isfinite(reset):
            return secondary_wait_s
        return max(0.0, reset - time.time()) + 0.05
    if response.status_code == 429 or "rate limit" in message.lower():
        return float(min(secondary_wait_s * (2**secondary_hits), max_wait_s + 1.0))
    return None


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds before retry `attempt + 1`: exponential from `base_s` up to `cap_s`, with its
    upper half jittered so that clients that failed together do not retry together."""
    ceiling = min(cap_s, base_s * (2**attempt))
    return float(ceiling / 2 + random.uniform(0, ceiling / 2))


class WriteSpacing:
    """Keeps writes at least an interval apart, across every task of one client."""

    def __init__(self) -> None:
        self._last_write = 0.0
        self._lock = asyncio.Lock()

    async def wait(self, interval_s: float) -> None:
        """Return once `interval_s` has passed since the last write; that write is now."""
        if interval_s <= 0:
            return
        async with self._lock:
            wait = self._last_write + interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_write = time.monotonic()
