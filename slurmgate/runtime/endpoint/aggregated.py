"""The aggregated path: a request tried on up to max_attempts lanes, the last failure answering.

A request is tried on at most ``max_attempts`` distinct lanes; it moves on when the connection
to a lane could not be made, when a reused idle connection died before any byte of the answer
(once per request), on the first-byte timeout, on 429 and 500/502/503/504, and when its lane
leaves rotation before answering. A request that was sent whole and then dropped, or whose
answer broke off, is not retried (502): it may be what killed its lane, and re-sent it would
kill every replica. Each attempt is one ``forward.Attempt``; this loop reads its outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slurmgate.runtime.endpoint.answers import bad_gateway, overloaded
from slurmgate.runtime.endpoint.backpressure import Lane
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming
from slurmgate.runtime.endpoint.forward import (
    Answered,
    BrokenStream,
    BrokeOff,
    Buffered,
    CutOff,
    Failure,
    LaneLinks,
    NotConnected,
    Stale,
    TimedOut,
    pass_on,
    read_if_small,
    read_whole,
)
from slurmgate.runtime.endpoint.heads import request_head, response_headers, retry_after_of
from slurmgate.runtime.endpoint.metrics import EndpointStats
from slurmgate.runtime.endpoint.routing import LeastActiveRouter

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})

DROPPED = (
    "the backend dropped the request after it was sent; not retried, since the "
    "request itself may have broken it"
)


@dataclass
class _Tries:
    """What one request's attempts so far leave for its answer."""

    failures: list[str] = field(default_factory=list)  # reasons; all but a final one were retries
    last: Buffered | None = None  # the last retryable answer; None after a connection failure
    saw_overload: bool = False
    first_retry_after: bytes | None = None  # of the first 429 that named one
    dropped: bool = False  # a lane dropped the request after it was sent: no more attempts
    stale_retried: bool = False

    def failed(self, outcome: Failure | BrokeOff) -> tuple[bool | None, bool]:
        """Note a failed attempt: the lane breaker's verdict, and whether another lane may
        be tried."""
        self.last = None
        match outcome:
            case Stale() if not self.stale_retried:
                # the lane closed its idle connection as it was reused: a known race
                self.stale_retried = True
                self.failures.append(outcome.reason)
                return None, True
            case CutOff():
                self.failures.append(outcome.reason)
                return None, True
            case NotConnected() | TimedOut():
                self.failures.append(outcome.reason)
                return False, True
            case BrokeOff():  # the answer began: what was sent may have broken the lane
                self.failures.append(outcome.reason)
                self.dropped = True
                return False, False
            case _:  # sent whole and lost (a second stale connection too)
                self.failures.append("dropped")
                self.dropped = True
                return False, False

    def refused(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A retryable status: kept, in case no other lane answers better."""
        self.last = Buffered(status, headers, body)
        if status == 429:
            self.saw_overload = True
            if self.first_retry_after is None:
                self.first_retry_after = retry_after_of(headers)
        self.failures.append(str(status))


class AggregatedPath:
    """Route, retry and answer a request over one router's lanes."""

    def __init__(
        self,
        config: EndpointConfig,
        stats: EndpointStats,
        router: LeastActiveRouter,
        links: LaneLinks,
        not_forwarded: frozenset[bytes],
    ) -> None:
        self.config = config
        self.stats = stats
        self.router = router
        self.links = links
        self.not_forwarded = not_forwarded
        self.retry_after = config.retry_after_header
        self.attempt_cap = min(config.max_attempts, len(router.lanes))

    async def forward(self, conn: ClientConnection, req: Incoming) -> int:
        stats = self.stats
        before, after = request_head(req, self.not_forwarded)
        hosts = self.links.hosts
        tries = _Tries()
        tried: list[Lane] = []
        for _ in range(self.attempt_cap):
            lane = self.router.pick(time.monotonic(), tried)
            if lane is None:
                if not tried:
                    stats.rejected_overload += 1
                    message = "every backend is over its queue limit"
                    return overloaded(conn, req, self.config, self.retry_after, message)
                # The untried lanes are over their queue limit: that is an overload too.
                tries.saw_overload = True
                break
            tried.append(lane)
            stats.attempts += 1
            attempt = self.links.attempt(lane)
            await attempt.take()
            verdict: bool | None = None  # for the lane's breaker: answered well, or failed
            try:
                outcome = await attempt.forward(before + hosts[lane.index] + after, req.body)
                if not isinstance(outcome, Answered):
                    verdict, another = tries.failed(outcome)
                    if another:
                        continue
                    break
                upstream = outcome.upstream
                status = upstream.status
                verdict = status < 500  # a 4xx is the client's fault, or the lane being busy
                if status in RETRY_STATUSES:
                    data = await read_whole(upstream)
                    body = b"" if isinstance(data, BrokeOff) else data
                    tries.refused(status, upstream.headers, body)
                    continue
                whole = await read_if_small(upstream, req)
                if isinstance(whole, BrokeOff):
                    verdict, _ = tries.failed(whole)
                    break
                for reason in tries.failures:
                    stats.retries[reason] += 1
                try:
                    idle = attempt.timeouts.stream_idle
                    return await pass_on(conn, req, upstream, whole, idle)
                except BrokenStream:
                    verdict = False
                    raise
            finally:
                attempt.close(verdict)
        return self._exhausted(conn, req, tries)

    def _exhausted(self, conn: ClientConnection, req: Incoming, tries: _Tries) -> int:
        """Out of attempts (or of admitted lanes): the last failure decides the answer."""
        for reason in tries.failures[:-1]:
            self.stats.retries[reason] += 1
        if tries.dropped:
            return bad_gateway(conn, req, DROPPED)
        last = tries.last
        retry_after = tries.first_retry_after or self.retry_after
        if last is None:
            if tries.saw_overload:
                message = "backends overloaded or unreachable; retry later"
                overloaded(conn, req, self.config, retry_after, message)
                return 429
            return bad_gateway(conn, req, "backend unavailable")
        out = response_headers(last.headers)
        if last.status == 429 and retry_after_of(out) is None and retry_after:
            out.append((b"retry-after", retry_after))
        conn.send_full(req, last.status, out, last.body)
        return last.status
