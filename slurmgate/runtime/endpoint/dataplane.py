"""The endpoint's data plane, client side: HTTP/1.1 over raw asyncio protocols and httptools.

Why not uvicorn + ASGI downstream and aiohttp upstream, as before: measured with wrk against the
DataDesigner proxy (``benchmarks/bench_endpoint.py``), that stack cost 0.70-0.78x the peer's CPU
per request and this data plane 0.19-0.30x, with the same routing, retry and limit code, so most
of the old cost was the two HTTP stacks' per-request objects (ASGI scope and messages, a task per
message, aiohttp's request, response, multidicts, URLs and timers). Here a request is parsed by
httptools straight into one small object, the upstream answer is parsed by httptools on a pooled
connection, and a streamed answer is written to the client from the upstream protocol's
callback, with no await per chunk. Routing, retries and limits stay outside (``app.py``,
``forward.py``); this module only speaks HTTP.

Downstream (``ClientConnection``): keep-alive, pipelined requests answered in order,
``Expect: 100-continue``, chunked or close-delimited framing of streamed answers, flow control
(a client that reads slowly pauses the upstream connection that feeds it), and an idle
keep-alive connection closed after ``CLIENT_KEEPALIVE_S``. What a client can make it hold is
bounded, since clients are hostile:

- a head by its raw bytes as they arrive (``MAX_HEADER_BYTES``: 414 when the target is most of
  it, else 431) and by time (``CLIENT_HEAD_TIMEOUT_S``);
- a body by its declared length as soon as the head is in, on every path and for pipelined
  requests too (413), and by what has arrived: nothing is reserved or allocated before it came
  (the endpoint's ``reserve`` and ``release`` keep the total); ``/health`` and ``/metrics``
  take none;
- a body's time by the endpoint's ``body_timeout`` (408);
- a connection refused early (401, 413, 429, 408, a bad head) is not drained: the answer goes
  out, the write side is shut, and the connection closes when the client closes it or after
  ``LINGER_S`` (closing at once could reset it before the client read the answer);
- the number of client connections by ``limit`` (503 and close past it).

The lane side, pooled connections to the lanes, is ``upstream.py``.
"""

from __future__ import annotations

import asyncio
import http
import time
from collections import deque
from typing import Protocol, cast

import httptools

from slurmgate.runtime.endpoint.upstream import UpstreamConnection

CLIENT_KEEPALIVE_S = 5.0  # as uvicorn's default: an idle client connection is closed after it
# A request head must arrive whole within this: a client that trickles one (slowloris) would
# otherwise hold its connection forever.
CLIENT_HEAD_TIMEOUT_S = 10.0
# After an early answer, what the client still sends is read and dropped for at most this long.
LINGER_S = 2.0
MAX_HEADER_BYTES = 64 * 1024
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_AT_CAPACITY = (
    b'{"error": {"message": "the endpoint holds as many connections as it may", '
    b'"type": "overloaded", "code": 503}}'
)


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


class Incoming:
    """One request from a client, as parsed, plus what answering it needs."""

    __slots__ = (
        "answered",
        "body",
        "chunked_out",
        "complete",
        "declared",
        "expect_continue",
        "gone",
        "head_only",
        "headers",
        "http11",
        "keep_alive",
        "method",
        "reserved",
        "responded",
        "size",
        "target",
        "task",
        "too_large",
    )

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.http11 = True
        self.body: bytes | bytearray = b""
        self.size = 0
        self.declared: int | None = None
        self.reserved = 0  # bytes of the endpoint's body budget this request holds
        self.answered = False  # an answer was started (early ones while the body still arrives)
        self.complete = False  # the whole request was read
        self.responded = False  # the answer is finished
        self.chunked_out = False
        self.head_only = False
        self.gone = False
        self.task: asyncio.Task[None] | None = None
        self.too_large = False
        self.expect_continue = False


class Handler(Protocol):
    """What the data plane asks of the endpoint."""

    max_body_bytes: int

    def admit(self, conn: ClientConnection, req: Incoming) -> bool:
        """Headers are in: answer at once (and return False) or let the body come."""

    def reserve(self, size: int) -> bool: ...

    def release(self, size: int) -> None: ...

    def too_large(self, conn: ClientConnection, req: Incoming) -> None: ...

    def buffer_full(self, conn: ClientConnection, req: Incoming) -> None: ...

    def body_timed_out(self, conn: ClientConnection, req: Incoming) -> None: ...

    def refused(self, status: int) -> None:
        """The data plane answered a request itself (a bad or oversized head, no room)."""

    def client_write_paused(self, lane_paused: bool) -> None:
        """A client's socket is full; ``lane_paused``: the lane feeding it waits too."""

    def dispatch(self, conn: ClientConnection, req: Incoming) -> None:
        """The whole request is in: start answering it."""


class ClientConnection(asyncio.Protocol):
    """One client's HTTP/1.1 connection to the endpoint."""

    def __init__(
        self, handler: Handler, connections: set[ClientConnection], limit: int = 1 << 30
    ) -> None:
        self.handler = handler
        self.connections = connections
        self.limit = limit  # client connections open at once, this one included
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.parsing: Incoming | None = None
        self.active: Incoming | None = None  # the request being answered
        self.waiting: deque[Incoming] = deque()  # pipelined requests behind it
        self.header_bytes = 0  # of the head being parsed, as the parser handed it over
        # Raw bytes of the head being received, counted as they arrive: the parser keeps an
        # unfinished header value to itself, so its callbacks alone cannot bound a head.
        self.head_open = True  # between requests, or inside a head
        self.head_bytes = 0
        self.url_parts: list[bytes] = []
        self.url_bytes = 0
        self.refusal: tuple[int, bytes] | None = None  # set by a callback before it raises
        self.idle_since: float | None = time.monotonic()
        self.head_since: float | None = None  # a request head started arriving then
        self.body_since: float | None = None  # the active request's body is awaited since
        self.linger_since: float | None = None  # answered early; closing
        self.write_paused = False
        self.feeder: UpstreamConnection | None = None  # the upstream streaming into us
        # A streamed answer's writes, held while corked and written as one (``cork``).
        self.corked: list[bytes] | None = None
        self.closed = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if len(self.connections) >= self.limit:
            # No room: answered at once and closed, so the file descriptors the endpoint needs
            # to reach its lanes are never all taken by clients.
            self.closed = True
            self.handler.refused(503)
            self.transport.write(
                status_line(503)
                + b"content-type: application/json\r\nconnection: close\r\nretry-after: 1\r\n"
                + b"content-length: %d\r\n\r\n" % len(_AT_CAPACITY)
                + _AT_CAPACITY
            )
            self.transport.close()
            return
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        for req in (self.active, self.parsing, *self.waiting):
            if req is None:
                continue
            req.gone = True
            if req.task is not None and not req.task.done():
                req.task.cancel()
            elif req.task is None:
                self._give_back(req)
        self.waiting.clear()
        feeder, self.feeder = self.feeder, None
        if feeder is not None:
            feeder.resume()

    def data_received(self, data: bytes) -> None:
        if self.linger_since is not None or self.closed:
            return  # answered early: what still comes is dropped
        if self.head_open:
            # an upper bound: a head that ends in this data resets the count when it does
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An Upgrade (h2c, websocket) is not taken: the request is answered over HTTP/1.1
            # and the connection closes after it (what follows the request is not HTTP/1.1).
            if self.active is not None:
                self.active.keep_alive = False
                if self.active.responded and self.transport is not None:
                    self.transport.close()
            elif self.transport is not None:
                self.transport.close()
        except httptools.HttpParserError:
            if self.linger_since is not None:
                return
            status, message = self.refusal or (400, b"Invalid HTTP request received.")
            self._fail(status, message)
            return
        if self.head_open and self.head_bytes > MAX_HEADER_BYTES:
            self._head_too_large()

    def _head_too_large(self) -> None:
        if self.url_bytes * 2 > self.head_bytes:
            self._fail(414, b"Request target over %d bytes." % MAX_HEADER_BYTES)
        else:
            self._fail(431, b"Request head over %d bytes." % MAX_HEADER_BYTES)

    def eof_received(self) -> bool | None:
        return None

    def pause_writing(self) -> None:
        self.write_paused = True
        self.handler.client_write_paused(self.feeder is not None)
        if self.feeder is not None:
            self.feeder.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.feeder is not None:
            self.feeder.resume()

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.linger_since is not None:  # answered early: nothing after it is parsed
            raise httptools.HttpParserError("connection closing")
        self.parsing = Incoming()
        self.header_bytes = 0
        self.idle_since = None
        self.head_since = time.monotonic()

    def on_url(self, url: bytes) -> None:
        # Pieces are joined once the head is in: adding each to the last copies it all again.
        self.url_parts.append(url)
        self.url_bytes += len(url)
        if self.url_bytes > MAX_HEADER_BYTES:
            self.refusal = (414, b"Request target over %d bytes." % MAX_HEADER_BYTES)
            raise httptools.HttpParserError("request target too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.parsing
        assert req is not None
        self.header_bytes += len(name) + len(value)
        if self.header_bytes + self.url_bytes > MAX_HEADER_BYTES:
            self.refusal = (431, b"Request head over %d bytes." % MAX_HEADER_BYTES)
            raise httptools.HttpParserError("request headers too large")
        req.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        req = self.parsing
        assert req is not None
        started, self.head_since = self.head_since, None
        self.head_open = False
        self.head_bytes = 0
        parts = self.url_parts
        req.target = parts[0] if len(parts) == 1 else b"".join(parts)
        self.url_parts = []
        self.url_bytes = 0
        parser = self.parser
        req.method = parser.get_method()
        req.keep_alive = parser.should_keep_alive()
        req.http11 = parser.get_http_version() == "1.1"
        req.head_only = req.method == b"HEAD"
        for key, value in req.headers:
            if key == b"content-length":
                try:
                    req.declared = int(value)
                except ValueError:
                    req.declared = -1
            elif key == b"expect" and value.lower() == b"100-continue":
                req.expect_continue = True
        if req.declared is not None and req.declared > self.handler.max_body_bytes:
            req.too_large = True  # refused at its turn, on any path; nothing of it is kept
        if self.active is None:
            self.active = req
            self.body_since = started  # the head and its body are due within body_timeout
            self._begin(req)
        else:
            self.waiting.append(req)
            if self.transport is not None:
                self.transport.pause_reading()

    def on_body(self, chunk: bytes) -> None:
        req = self.parsing
        assert req is not None
        if req.answered or req.too_large:
            return  # answered early (or to be): nothing more of it is kept
        end = req.size + len(chunk)
        if end > self.handler.max_body_bytes:
            self._drop_body(req)
            req.too_large = True
            if req is self.active:
                self.handler.too_large(self, req)
            return
        # The budget grows with what arrived, never with what a head declared (a client could
        # declare the whole budget and send nothing); a pipelined body joins it at its turn.
        if req is self.active:
            if not self.handler.reserve(len(chunk)):
                self._drop_body(req)
                self.handler.buffer_full(self, req)
                return
            req.reserved += len(chunk)
        if not req.size:
            req.body = chunk  # the usual case: the body in one piece
        else:
            if not isinstance(req.body, bytearray):
                req.body = bytearray(req.body)
            req.body += chunk
        req.size = end

    def on_message_complete(self) -> None:
        req = self.parsing
        assert req is not None
        self.parsing = None
        # The next head's bytes in this same data go uncounted: a head may hold at most one
        # read's worth more than the limit.
        self.head_open = True
        self.head_bytes = 0
        req.complete = True
        if req is not self.active or self.linger_since is not None:
            return
        self.body_since = None
        if req.answered:
            if req.responded:
                self._next()
            return
        self.handler.dispatch(self, req)

    # -- answering -----------------------------------------------------------------------

    def _begin(self, req: Incoming) -> None:
        """The request's turn has come: its headers are judged (its body may be in already)."""
        if req.too_large:
            self.handler.too_large(self, req)
            return
        if not self.handler.admit(self, req):
            return
        if req.size and req.reserved == 0:
            # a pipelined body read before its turn: it joins the budget now
            if not self.handler.reserve(req.size):
                self.handler.buffer_full(self, req)
                return
            req.reserved = req.size
        if req.expect_continue and not req.complete and self.transport is not None:
            self.transport.write(_CONTINUE)
        if req.complete:
            self.handler.dispatch(self, req)

    def _drop_body(self, req: Incoming) -> None:
        req.body, req.size = b"", 0
        self._give_back(req)

    def _give_back(self, req: Incoming) -> None:
        if req.reserved:
            self.handler.release(req.reserved)
            req.reserved = 0

    def _fail(self, status: int, message: bytes) -> None:
        """A head the parser refused: answered (unless an answer already began), then closed."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if self.active is None or not self.active.answered:
                self.handler.refused(status)
                transport.write(
                    status_line(status)
                    + b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                    + b"content-length: %d\r\n\r\n" % len(message)
                    + message
                )
                self._linger()
            else:
                self.flush()  # a streamed answer's last bytes, held for its end
                transport.close()

    def _linger(self) -> None:
        """The answer is out and the connection ends: shut the write side and drop whatever
        the client still sends until it closes, at most ``LINGER_S`` (the sweeper's part)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.linger_since = time.monotonic()
        self.body_since = self.head_since = self.idle_since = None
        transport.resume_reading()  # it may have been paused behind a pipelined request
        if transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()

    def past_deadline(self, now: float, body_timeout: float) -> bool:
        """Whether the connection is past one of its deadlines and must be cut; a body that is
        late is answered 408 here instead (and the connection lingers)."""
        if self.linger_since is not None:
            return now - self.linger_since > LINGER_S
        if self.idle_since is not None and now - self.idle_since > CLIENT_KEEPALIVE_S:
            return True
        if self.head_since is not None and now - self.head_since > CLIENT_HEAD_TIMEOUT_S:
            return True
        body_since, req = self.body_since, self.active
        if body_since is not None and now - body_since > body_timeout and req is not None:
            self.body_since = None
            if not req.complete and not req.answered:
                self.handler.body_timed_out(self, req)
        return False

    def send_full(
        self, req: Incoming, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """A whole answer; ``headers`` carry no framing (content-length is added here)."""
        req.answered = True
        if self.closed or self.transport is None:
            self.finish(req)
            return
        parts = [status_line(status)]
        parts += [b"%s: %s\r\n" % pair for pair in headers]
        if not req.complete:
            req.keep_alive = False  # answered before its body was read: the connection ends
        if not req.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"content-length: %d\r\n\r\n" % len(body))
        if not req.head_only:
            parts.append(body)
        self.transport.write(b"".join(parts))
        self.finish(req)

    def send_head(
        self,
        req: Incoming,
        status: int,
        headers: list[tuple[bytes, bytes]],
        length: int | None,
    ) -> None:
        """The head of a streamed answer: its body follows with send_chunk, then send_end."""
        req.answered = True
        if self.closed or self.transport is None:
            return
        parts = [status_line(status)]
        parts += [b"%s: %s\r\n" % pair for pair in headers]
        if req.head_only or status in (204, 304):
            if length is not None:
                parts.append(b"content-length: %d\r\n" % length)
        elif length is not None:
            parts.append(b"content-length: %d\r\n" % length)
        elif req.http11:
            req.chunked_out = True
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            req.keep_alive = False  # HTTP/1.0 without a length: the end is the close
        if not req.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self._write(b"".join(parts))

    def send_chunk(self, req: Incoming, data: bytes) -> None:
        if self.closed or req.head_only or not data or self.transport is None:
            return
        if req.chunked_out:
            self._write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self._write(data)

    def send_end(self, req: Incoming) -> None:
        if not self.closed and req.chunked_out and not req.head_only and self.transport:
            self._write(b"0\r\n\r\n")
        self.uncork()
        self.finish(req)

    def cork(self) -> None:
        """Hold a streamed answer's writes until ``flush``, ``uncork`` or ``send_end``.

        Why: each write is a system call, and a lane's read often holds several chunks (at
        saturation, a short answer whole): written one by one, an 8-chunk SSE answer took
        ten writes, a third of the event loop's time. The bytes and their order are the
        same; only the number of writes changes."""
        if self.corked is None:
            self.corked = []

    def flush(self) -> None:
        """Write what the cork holds as one write (it stays corked)."""
        parts = self.corked
        if not parts:
            return
        self.corked = []
        transport = self.transport
        if not self.closed and transport is not None and not transport.is_closing():
            transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def uncork(self) -> None:
        """Write what the cork holds; later writes go out at once again."""
        self.flush()
        self.corked = None

    def _write(self, data: bytes) -> None:
        corked = self.corked
        if corked is not None:
            corked.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def abort(self) -> None:
        """Cut the connection: the answer cannot be completed (the backend broke mid-way)."""
        self.flush()  # what came before the break goes out, as it did when written at once
        if self.transport is not None:
            self.transport.close()

    def finish_request(self, req: Incoming) -> None:
        """The request's handler is done with it: its share of the body budget goes back."""
        self._give_back(req)

    def finish(self, req: Incoming) -> None:
        """The answer is complete; the next request may go once this one was read whole."""
        req.responded = True
        self._give_back(req)
        if req is not self.active or self.closed:
            return
        if not req.keep_alive:
            if not req.complete:
                self._linger()  # the body was not read: closing now could reset the answer
            elif self.transport is not None:
                self.transport.close()
            return
        if req.complete:
            self._next()

    def _next(self) -> None:
        self.active = None
        if self.waiting:
            req = self.waiting.popleft()
            self.active = req
            if not self.waiting and self.transport is not None:
                self.transport.resume_reading()
            self.body_since = time.monotonic()  # its body could not come while it waited
            self._begin(req)
        elif self.parsing is None:
            self.idle_since = time.monotonic()
