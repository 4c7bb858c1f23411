"""One attempt to forward a request to one lane, and its typed outcome.

An attempt is one request on one lane, from taking the lane's slot to giving it back, in steps
whose seams are the places to change:

- ``Attempt.take`` counts the request on the lane (``requests``, ``active``) and waits for the
  lane's gate, its share of the lane's connections, counted as ``queued`` while it waits;
  ``Attempt.close`` gives back the connection, the gate and the count, with the breaker's
  verdict (``True`` answered well, ``False`` failed, ``None`` no verdict); only its first call
  counts, so a leg may give its slot back as soon as its answer is in, before its request ends.
- ``Attempt.connect`` takes a connection from the lane's pool within the connect timeout.
- ``Attempt.send`` sends the head and the body, as the caller built them (nothing here parses
  or rewrites a body), and waits for the answer's head within the first-byte timeout;
  ``Attempt.watched`` runs such a wait given up (``CutOff``) when the lane leaves rotation.
- ``read_whole`` reads an answer's body whole (``read_if_small`` when it is small); ``pass_on``
  sends it to the client whole, or streams it (``relay``) under the stream's idle timeout; once
  its first byte went out nothing can be retried, and a break cuts the client (``BrokenStream``).

Each step returns an outcome value instead of raising for a failure of the lane; the retry and
routing decisions (``aggregated.py``, ``disaggregated.py``) read its type. Cancellation (the
client left, the server stops) is not an outcome: it propagates, and ``close`` still runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import ClassVar, TypeVar
from urllib.parse import urlsplit

from slurmgate.errors import ExternalError
from slurmgate.runtime.endpoint.backpressure import Lane
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming
from slurmgate.runtime.endpoint.heads import response_headers
from slurmgate.runtime.endpoint.upstream import LanePool, UpstreamConnection, UpstreamError

SMALL_BODY = 64 * 1024  # an answer up to this size is read whole before it is passed on
T = TypeVar("T")

# -- outcomes -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answered:
    """The answer's head is in; its body is still on the attempt's connection."""

    upstream: UpstreamConnection

    @property
    def status(self) -> int:
        return self.upstream.status


@dataclass(frozen=True, slots=True)
class Buffered:
    """An answer read whole, kept in memory in case it becomes the request's."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True, slots=True)
class NotConnected:
    """No connection to the lane could be made: nothing was sent."""

    timed_out: bool  # the connect timeout ran out (else the connection was refused or failed)
    reason: ClassVar[str] = "connect"


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The request was sent and no byte of its answer came within the first-byte timeout."""

    timed_out: ClassVar[bool] = True
    reason: ClassVar[str] = "timeout"


@dataclass(frozen=True, slots=True)
class Stale:
    """A reused idle connection died before any byte of the answer: the lane had closed it."""

    timed_out: ClassVar[bool] = False
    reason: ClassVar[str] = "stale"


@dataclass(frozen=True, slots=True)
class Dropped:
    """The request was sent, then the lane's connection failed before its answer began."""

    timed_out: ClassVar[bool] = False
    reason: ClassVar[str] = "dropped"


@dataclass(frozen=True, slots=True)
class CutOff:
    """The lane left rotation while the attempt waited for its answer to begin."""

    timed_out: ClassVar[bool] = False
    reason: ClassVar[str] = "unhealthy"


@dataclass(frozen=True, slots=True)
class Interrupted:
    """The other leg of a paired request failed: this leg's wait was cut short."""

    timed_out: ClassVar[bool] = False
    reason: ClassVar[str] = "interrupted"


@dataclass(frozen=True, slots=True)
class BrokeOff:
    """The answer had begun, then its connection failed or went silent before it was whole."""

    timed_out: bool
    reason: ClassVar[str] = "broken"


Failure = NotConnected | TimedOut | Stale | Dropped | CutOff | Interrupted
Sent = Answered | TimedOut | Stale | Dropped | Interrupted  # what a connection's send ends in
Outcome = Answered | Failure


class PartnerFailed(ExternalError):
    """The other leg of a disaggregated request failed: this leg's wait is cut short."""


class BrokenStream(ExternalError):
    """The backend broke after the answer had started: the client's connection is cut."""


# -- one attempt ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The times an attempt waits: for a connection, for its answer's first byte, for each
    next byte of a streamed answer."""

    connect: float
    first_byte: float
    stream_idle: float

    @classmethod
    def of(cls, config: EndpointConfig) -> Timeouts:
        return cls(config.connect_timeout, config.first_byte_timeout, config.read_timeout)


class Attempt:
    """One request on one lane: its slot, its connection, its send; given back by ``close``."""

    __slots__ = ("closed", "gate", "lane", "pool", "timeouts", "upstream")

    def __init__(
        self, lane: Lane, gate: asyncio.Semaphore, pool: LanePool, timeouts: Timeouts
    ) -> None:
        self.lane = lane
        self.gate = gate
        self.pool = pool
        self.timeouts = timeouts
        self.upstream: UpstreamConnection | None = None
        self.closed = False

    async def take(self) -> None:
        """Count the request on its lane and take the lane's gate, counted as queued while it
        waits; cancelled while it waits, it leaves no count behind."""
        lane, gate = self.lane, self.gate
        lane.requests += 1
        lane.active += 1
        if gate.locked():
            lane.queued += 1
            try:
                await gate.acquire()
            except BaseException:
                lane.active -= 1
                raise
            finally:
                lane.queued -= 1
        else:
            await gate.acquire()

    def close(self, verdict: bool | None) -> None:
        """Give back the connection (to the pool when it ended cleanly), the gate and the
        count; the breaker hears ``verdict``, or that the attempt was abandoned (``None``).
        A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        lane = self.lane
        if verdict is None:
            lane.breaker.abandoned()
        else:
            lane.breaker.record(verdict, time.monotonic())
        if self.upstream is not None:
            self.pool.release(self.upstream)
            self.upstream = None
        self.gate.release()
        lane.active -= 1

    async def connect(self) -> NotConnected | None:
        """Take a connection from the lane's pool (a new one within the connect timeout)."""
        try:
            self.upstream = await self.pool.acquire(self.timeouts.connect)
        except (OSError, TimeoutError, UpstreamError) as exc:
            return NotConnected(timed_out=isinstance(exc, TimeoutError))
        return None

    async def reconnect(self) -> NotConnected | None:
        """Replace the connection by a new one to the same lane (the old one is given back)."""
        if self.upstream is not None:
            self.pool.release(self.upstream)
            self.upstream = None
        return await self.connect()

    async def send(self, head: bytes, body: bytes | bytearray) -> Sent:
        """Send the request on the connection and wait for its answer's head, at most the
        first-byte timeout after the body went out."""
        upstream = self.upstream
        assert upstream is not None, "send before connect"
        try:
            await upstream.send(head, body, self.timeouts.first_byte)
        except TimeoutError:  # an OSError too: told apart first
            return TimedOut()
        except (OSError, UpstreamError):
            return Stale() if self.reused_unanswered else Dropped()
        except PartnerFailed:
            return Interrupted()
        return Answered(upstream)

    async def forward(self, head: bytes, body: bytes | bytearray) -> Outcome:
        """Connect and send; given up (``CutOff``) when the lane leaves rotation meanwhile,
        since a wedged engine would hold the request until the first-byte timeout."""
        return await self.watched(self._connect_and_send(head, body))

    async def _connect_and_send(self, head: bytes, body: bytes | bytearray) -> Outcome:
        not_connected = await self.connect()
        if not_connected is not None:
            return not_connected
        return await self.send(head, body)

    async def watched(self, step: Awaitable[T]) -> T | CutOff:
        """Await ``step`` (a wait for the lane's answer) as one the lane's health prober may
        cut short: a lane that leaves rotation cancels it, and it ends ``CutOff``."""
        me = asyncio.current_task()
        assert me is not None
        lane = self.lane
        lane.awaiting.add(me)
        try:
            return await step
        except asyncio.CancelledError:
            if me not in lane.cut_off:
                raise
            lane.cut_off.discard(me)
            if me.uncancel() > 0:
                raise  # cancelled for another reason too (the client left)
            return CutOff()
        finally:
            lane.awaiting.discard(me)

    @property
    def reused_unanswered(self) -> bool:
        """The connection was an idle one reused, and no byte of this answer came on it."""
        upstream = self.upstream
        return upstream is not None and upstream.reused and not upstream.received

    def interrupt(self) -> None:
        """Give the exchange up from outside: its ``send`` returns ``Interrupted``."""
        if self.upstream is not None:
            self.upstream.abort(PartnerFailed())


# -- the answer -----------------------------------------------------------------------------


async def read_whole(upstream: UpstreamConnection) -> bytes | BrokeOff:
    """The rest of an answer's body, whole (each gap at most the first-byte timeout)."""
    try:
        return await upstream.read_all()
    except (OSError, TimeoutError, UpstreamError) as exc:
        return BrokeOff(timed_out=isinstance(exc, TimeoutError))


async def read_if_small(upstream: UpstreamConnection, req: Incoming) -> bytes | BrokeOff | None:
    """An answer's body read whole before any of it goes out, when it is small; None when it
    is to be streamed. Until the first byte goes out, the request may still be retried."""
    length = upstream.content_length
    if length is None or length > SMALL_BODY or req.head_only:
        return None
    return await read_whole(upstream)


async def pass_on(
    conn: ClientConnection,
    req: Incoming,
    upstream: UpstreamConnection,
    whole: bytes | None,
    idle_timeout: float,
) -> int:
    """The lane's answer to the client: sent whole when it was read whole, else streamed."""
    status = upstream.status
    headers = response_headers(upstream.headers)
    if whole is not None:
        conn.send_full(req, status, headers, whole)
        return status
    return await relay(conn, req, upstream, status, headers, idle_timeout)


async def relay(
    conn: ClientConnection,
    req: Incoming,
    upstream: UpstreamConnection,
    status: int,
    headers: list[tuple[bytes, bytes]],
    idle_timeout: float,
) -> int:
    """Stream a non-retryable upstream answer to the client; no retry after this point.
    What each of the lane's reads brings goes out as one write, with the head before the
    first and the end after the last (``ClientConnection.cork``)."""
    conn.cork()
    try:
        conn.send_head(req, status, headers, upstream.content_length)

        def sink(data: bytes) -> None:
            conn.send_chunk(req, data)

        conn.feeder = upstream
        if conn.write_paused:
            upstream.pause()
        try:
            # The answer has begun: from here on a gap is the stream's idle timeout.
            await upstream.stream(sink, idle_timeout, conn.flush)
        except (OSError, TimeoutError, UpstreamError) as exc:
            raise BrokenStream("the backend broke mid-answer") from exc
        finally:
            conn.feeder = None
        conn.send_end(req)
    finally:
        conn.uncork()  # what came before a break still goes out, as it did chunk by chunk
    return status


class LaneLinks:
    """Every lane's gate, connection pool and Host header, by lane index: what attempts use."""

    def __init__(self, lanes: list[Lane], per_lane: int, timeouts: Timeouts) -> None:
        # One gate per lane, the size of its share of the pool: a request waiting at the gate
        # is visible (``lane.queued``), and counts as waiting in the lane's queue.
        self.gates = [asyncio.Semaphore(per_lane) for _ in lanes]
        self.hosts = [lane.url.removeprefix("http://").encode() for lane in lanes]
        self.pools: list[LanePool] = []  # the data plane's upstream connections, one per lane
        self.timeouts = timeouts

    def open_pools(self, lanes: list[Lane], keepalive_timeout: float) -> None:
        """One pool per lane, in the running event loop."""
        self.pools = [
            LanePool(parts.hostname or "", parts.port or 80, keepalive_timeout)
            for parts in (urlsplit(lane.url) for lane in lanes)
        ]

    def close_pools(self) -> None:
        for pool in self.pools:
            pool.close()

    def attempt(self, lane: Lane) -> Attempt:
        return Attempt(lane, self.gates[lane.index], self.pools[lane.index], self.timeouts)
