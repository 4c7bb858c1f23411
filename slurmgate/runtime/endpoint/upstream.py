"""The data plane's lane side: pooled keep-alive HTTP/1.1 connections to the lanes, httptools.

Per-lane pools of keep-alive connections (``LanePool``), each carrying one request at a time
(``UpstreamConnection``): a first-byte timeout until the answer starts, then the stream's idle
timeout, both checked by one timer per connection that re-arms itself instead of being reset
on every read, and serves the connection's next exchanges too. A streamed answer is handed to
a sink from the protocol's callback, with no await per chunk; a client that reads slowly
pauses the connection that feeds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import cast

import httptools

from slurmgate.errors import ExternalError

# Larger request bodies go upstream in slices of this size, each after the last was taken: handed
# over whole, the transport would copy what the socket did not take at once, holding it twice.
BODY_SLICE = 1024 * 1024
QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class UpstreamError(ExternalError):
    """The backend's connection failed or closed before its answer was complete."""

    transient = True


class UpstreamConnection(asyncio.Protocol):
    """One pooled keep-alive connection to a backend; carries one request at a time."""

    def __init__(self, pool: LanePool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sock: socket.socket | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        # Checks this connection's exchange for silence; kept between exchanges (``send``).
        self.timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.until_close = False
        self.parts: list[bytes] = []
        self.head_done = False
        self.complete = False
        self.received = False  # a byte of this exchange's answer came
        self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], None] | None = None
        self.flush: Callable[[], None] | None = None  # after each read's parts went to sink
        self.timeout = 0.0
        self.last_read = 0.0
        self.head_only = False
        self.writable: asyncio.Future[None] | None = None
        self.paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.sock = transport.get_extra_info("socket")

    def quick_ack(self) -> None:
        """Acknowledge the next segments at once rather than after Linux's delayed-ACK timer.

        Why: a server that writes an answer's head and its first chunk as two small writes
        without TCP_NODELAY (Dynamo 1.6.1's frontend is one) holds the chunk back until the head
        is acknowledged (Nagle's algorithm). On a fresh connection Linux acknowledges at once;
        on a pooled keep-alive one it waits up to 40 ms, which became every streamed answer's
        time to first token (``benchmarks/bench_dynamo.py``). The flag does not stay set: it
        is set when each answer's first bytes come, which acknowledges them at once."""
        if QUICKACK is not None and self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.head_done and self.until_close and exc is None:
            self._complete()  # an answer framed by neither length nor chunks ends at the close
        if not self.complete:
            self._fail(UpstreamError(f"backend closed the connection: {exc or 'EOF'}"))
        if self.writable is not None and not self.writable.done():
            self.writable.set_exception(UpstreamError("backend closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        first = not self.received
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad answer from the backend: {exc}"))
            self.close()
            return
        if not self.complete:
            if first:
                # The answer's first bytes, with more to come: acknowledged now, not in 40 ms.
                # An answer whole in its first read waits for nothing more, and the flag's
                # system call (uvloop makes and drops a socket object for it) was a tenth of
                # the event loop's time.
                self.quick_ack()
            if self.flush is not None:
                self.flush()  # an answer that ended here is flushed by whoever waits for it
        waiter = self.waiter
        if waiter is not None and (self.head_done or self.complete) and not waiter.done():
            waiter.set_result(None)

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer; the real one follows
            self.headers = []
            return
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()
        chunked = False
        for key, value in self.headers:
            if key == b"content-length":
                with contextlib.suppress(ValueError):
                    self.content_length = int(value)
            elif key == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        self.until_close = self.content_length is None and not chunked
        if self.head_only:
            # httptools cannot be told the answer has no body: end it here, never reuse it
            self.keep_alive = False
            self._complete()

    def on_body(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink(data)
        else:
            self.parts.append(data)

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self._complete()

    # -- one exchange --------------------------------------------------------------------

    def _complete(self) -> None:
        if self.complete:
            return
        self.complete = True  # the timer, left to run, then finds nothing to check
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _check_timeout(self) -> None:
        self.timer = None
        if self.complete or self.error is not None:
            return
        now = self.loop.time()
        due = self.last_read + self.timeout
        if now >= due:
            self._fail(TimeoutError(f"backend silent for {self.timeout:g} s"))
            self.close()
        else:
            self.timer = self.loop.call_at(due, self._check_timeout)

    async def send(self, head: bytes, body: bytes | bytearray, first_byte_timeout: float) -> None:
        """Send one request and wait until its answer's head is in (or it failed)."""
        self._reset()
        self.head_only = head.startswith(b"HEAD ")
        self.timeout = first_byte_timeout
        now = self.last_read = self.loop.time()
        due = now + first_byte_timeout
        # A timer left from the last exchange on this connection does, when it fires no later
        # than this one's due time (it re-arms itself for the rest): making and cancelling a
        # timer for each request cost 4% of the event loop's time.
        timer = self.timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self.timer = self.loop.call_at(due, self._check_timeout)
        transport = self.transport
        if transport is None or self.closed:
            raise UpstreamError("backend connection closed")
        if len(body) <= BODY_SLICE:
            transport.write(head + body if body else head)
        else:
            transport.write(head)
            view = memoryview(body)
            for start in range(0, len(view), BODY_SLICE):
                if self.writable is not None:
                    await self.writable
                if self.error is not None:
                    raise self.error
                transport.write(view[start : start + BODY_SLICE])
            self.last_read = self.loop.time()  # the first-byte wait starts after the body
        await self._wait(lambda: self.head_done)

    async def _wait(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def read_all(self) -> bytes:
        """The rest of the answer's body, whole."""
        await self._wait(lambda: self.complete)
        return b"".join(self.parts)

    async def stream(
        self,
        sink: Callable[[bytes], None],
        idle_timeout: float,
        flush: Callable[[], None] | None = None,
    ) -> None:
        """Hand the body to sink as it arrives, with the stream's idle timeout, until the end;
        ``flush`` is called once each read's parts went to sink, unless the answer ended in
        it (then the caller, woken, ends the answer)."""
        for part in self.parts:
            sink(part)
        self.parts = []
        self.sink = sink
        self.flush = flush
        self.timeout = idle_timeout
        if flush is not None and not self.complete:
            flush()
        await self._wait(lambda: self.complete)

    def abort(self, error: BaseException) -> None:
        """Give the exchange up: whoever waits on it gets ``error``; the connection closes."""
        self._fail(error)
        self.close()

    def pause(self) -> None:
        if self.transport is not None and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


class LanePool:
    """Idle keep-alive connections to one backend; new ones are opened on demand."""

    def __init__(self, host: str, port: int, keepalive_timeout: float) -> None:
        self.host = host
        self.port = port
        self.keepalive_timeout = keepalive_timeout
        self.loop = asyncio.get_running_loop()
        self.idle: list[UpstreamConnection] = []

    async def acquire(self, connect_timeout: float) -> UpstreamConnection:
        idle = self.idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > self.keepalive_timeout:
                conn.close()
                continue
            conn.reused = True
            return conn
        async with asyncio.timeout(connect_timeout):
            _, protocol = await self.loop.create_connection(
                lambda: UpstreamConnection(self), self.host, self.port
            )
        return protocol

    def release(self, conn: UpstreamConnection) -> None:
        """After an exchange: back to the pool when it ended cleanly, else closed (a pooled
        connection keeps its timer for the next exchange)."""
        if conn.closed or not conn.complete or not conn.keep_alive or conn.error is not None:
            conn.close()
            return
        conn.sink = None
        conn.flush = None
        conn.parts = []
        conn.resume()
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle = []
