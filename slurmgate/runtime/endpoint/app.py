"""The logical endpoint of one deployment: route, retry and stream requests to its lane heads.

Run it as ``python -m slurmgate.runtime.endpoint --name D --listen HOST:PORT --backend URL ...``
or ``slurmgate endpoint`` with the same flags (``config.py`` holds them).
The proxy path is a raw ASGI callable (it is on the hot path of every request); ``/health`` and
``/metrics`` are starlette routes beside it. Upstream requests go through one pooled aiohttp
``ClientSession`` (chosen by measurement over httpx, see ``benchmarks/bench_endpoint.py``).

Routing is least-active with a rotating cursor for ties (``routing.py``), gated per lane by the
sampled queue depth (``backpressure.py``) and by the lane's health probes, which take a failing
lane out of rotation. A request is tried on at most ``max_attempts`` distinct backends; it is
retried on connection errors, timeouts (the first-byte timeout among them), 429 and
500/502/503/504, and when its lane leaves rotation before answering; never after the response has
started streaming to the client.

Each lane has ``pool_size // lanes`` upstream connections; a request that waits for one is held
here and counts as waiting in the lane's queue. Request bodies are kept whole (a retry needs
them) and all of them together stay under ``max_buffered_bytes``. With a token in
``$SLURMGATE_ENDPOINT_TOKEN`` every request but ``GET /health`` must carry it as a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from yarl import URL

from slurmgate.runtime.endpoint.backpressure import (
    Lane,
    QueuePolicy,
    Sampler,
    metrics_query,
    start_samplers,
)
from slurmgate.runtime.endpoint.config import DEFAULT_PROG, EndpointConfig, parse_config
from slurmgate.runtime.endpoint.routing import LeastActiveRouter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Set by the upstream client itself: forwarding them would be wrong (Host) or duplicated.
NOT_FORWARDED_UP = HOP_BY_HOP | {b"host", b"content-length"}
SMALL_BODY = 64 * 1024
# Larger request bodies go upstream in slices of this size: handed over whole, the transport
# would copy what the socket did not take at once, holding the body twice.
BODY_SLICE = 1024 * 1024
CONTROL_PATHS = frozenset({"/health", "/metrics"})
BAD_TARGET = b"request target must be a path starting with /"


@dataclass
class EndpointStats:
    """Counters of the endpoint itself, rendered by ``/metrics``."""

    requests: int = 0
    attempts: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    rejected_overload: int = 0
    rejected_too_large: int = 0
    rejected_buffer_full: int = 0
    rejected_unauthorized: int = 0
    client_disconnects: int = 0
    broken_streams: int = 0


class _StatsCollector(Collector):
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def collect(self) -> Iterator[Any]:
        ep = self.endpoint
        stats = ep.stats
        name = ep.config.name
        now = time.monotonic()

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["endpoint"])
            family.add_metric([name], value)
            return family

        yield counter("slurmgate_endpoint_requests", "Requests received", stats.requests)
        yield counter("slurmgate_endpoint_attempts", "Upstream attempts", stats.attempts)
        yield counter(
            "slurmgate_endpoint_overload_rejections",
            "429s answered because every lane was over its queue limit",
            stats.rejected_overload,
        )
        yield counter(
            "slurmgate_endpoint_too_large",
            "413s for bodies over the limit",
            stats.rejected_too_large,
        )
        yield counter(
            "slurmgate_endpoint_buffer_full",
            "429s because the request bodies held already filled --max-buffered-bytes",
            stats.rejected_buffer_full,
        )
        yield counter(
            "slurmgate_endpoint_unauthorized",
            "401s for a missing or wrong bearer token",
            stats.rejected_unauthorized,
        )
        yield counter(
            "slurmgate_endpoint_client_disconnects",
            "Requests abandoned by the client",
            stats.client_disconnects,
        )
        yield counter(
            "slurmgate_endpoint_broken_streams",
            "Responses cut because the backend broke mid-stream",
            stats.broken_streams,
        )
        retries = CounterMetricFamily(
            "slurmgate_endpoint_retries", "Retries by reason", labels=["endpoint", "reason"]
        )
        for reason, count in sorted(stats.retries.items()):
            retries.add_metric([name, reason], count)
        yield retries
        statuses = CounterMetricFamily(
            "slurmgate_endpoint_responses", "Final statuses", labels=["endpoint", "status"]
        )
        for status, count in sorted(stats.statuses.items()):
            statuses.add_metric([name, str(status)], count)
        yield statuses
        labels = ["endpoint", "backend"]
        active = GaugeMetricFamily("slurmgate_backend_active", "In-flight requests", labels=labels)
        routed = CounterMetricFamily("slurmgate_backend_requests", "Attempts routed", labels=labels)
        depth = GaugeMetricFamily(
            "slurmgate_backend_queue_depth", "Last sampled queue depth (NaN if none)", labels=labels
        )
        admitted = GaugeMetricFamily(
            "slurmgate_backend_open", "1 when the lane takes new requests", labels=labels
        )
        failed = CounterMetricFamily(
            "slurmgate_backend_sample_failures", "Failed queue-depth scrapes", labels=labels
        )
        overdue = CounterMetricFamily(
            "slurmgate_backend_sample_overdue",
            "Queue-depth scrapes that outlasted --metrics-timeout",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "slurmgate_backend_queued",
            "Requests held here waiting for one of the lane's connections",
            labels=labels,
        )
        rotation = GaugeMetricFamily(
            "slurmgate_backend_in_rotation", "1 while the lane's health probes pass", labels=labels
        )
        for lane in ep.lanes:
            key = [name, lane.url]
            overdue.add_metric(key, lane.samples_overdue)
            queued.add_metric(key, lane.queued)
            rotation.add_metric(key, 1.0 if lane.in_rotation else 0.0)
            active.add_metric(key, lane.active)
            routed.add_metric(key, lane.requests)
            depth.add_metric(key, float("nan") if lane.depth is None else lane.depth)
            admitted.add_metric(key, 1.0 if ep.policy.admits(lane, now) else 0.0)
            failed.add_metric(key, lane.samples_failed)
        yield from (active, routed, depth, admitted, failed, overdue, queued, rotation)


@dataclass
class _Buffered:
    """A retryable upstream answer kept in memory in case it becomes the final one."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def _retry_after_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    for key, value in headers:
        if key.lower() == b"retry-after":
            return value
    return None


def _strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """Drop hop-by-hop headers and every header the Connection header nominates."""
    pairs = [(k.lower(), v) for k, v in headers]
    nominated: set[bytes] = set()
    for key, value in pairs:
        if key == b"connection":
            nominated.update(t.strip().lower() for t in value.split(b",") if t.strip())
    if not nominated:
        return [(k, v) for k, v in pairs if k not in drop]
    return [(k, v) for k, v in pairs if k not in drop and k not in nominated]


async def _slices(body: bytes | bytearray) -> AsyncIterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), BODY_SLICE):
        yield view[start : start + BODY_SLICE]


def _json_error(status: int, kind: str, message: str, **extra: Any) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": status, **extra}}
    ).encode()


class Endpoint:
    """The proxy's state and its raw ASGI request handler."""

    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self.lanes = [Lane(index=i, url=url) for i, url in enumerate(config.backends)]
        self.policy = QueuePolicy(max_waiting=config.max_waiting, stale_after=config.stale_after)
        self.router = LeastActiveRouter(self.lanes, self.policy)
        self.stats = EndpointStats()
        self.session: aiohttp.ClientSession | None = None
        # Scrapes and health probes get their own small pool: when traffic fills the proxy
        # pool, which is exactly when backpressure matters, they must not queue behind it.
        self.control: aiohttp.ClientSession | None = None
        self._sampler_tasks: list[asyncio.Task[None]] = []
        self._retry_after = config.retry_after_header
        # One gate per lane, the size of its share of the pool: a request waiting at the gate
        # is visible (``lane.queued``) where one waiting inside aiohttp's connector is not.
        self._per_lane = max(1, config.pool_size // len(self.lanes))
        self._gates = [asyncio.Semaphore(self._per_lane) for _ in self.lanes]
        self._buffered = 0  # bytes of request bodies held now, over all requests
        self._not_forwarded = NOT_FORWARDED_UP | (
            {b"authorization"} if config.token is not None else frozenset()
        )
        self._attempt_cap = min(config.max_attempts, len(self.lanes))
        self._urls: dict[tuple[int, str], URL] = {}  # parsing a URL per request costs ~10 us

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(
            limit=cfg.pool_size,
            limit_per_host=self._per_lane,
            keepalive_timeout=cfg.keepalive_timeout,
            use_dns_cache=True,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            # sock_connect, not connect: aiohttp's connect timeout also bounds the wait for a
            # pooled connection, which under load is queueing, not a dead backend.
            # sock_read is the first-byte timeout: it bounds the silence before the answer
            # starts; `_relay` lifts it to the stream's idle timeout once it has.
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=cfg.connect_timeout, sock_read=cfg.first_byte_timeout
            ),
            auto_decompress=False,
            # A proxy must never keep one client's cookies and send them for another.
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            raise_for_status=False,
        )
        self.control = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2 * len(self.lanes) + 8),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        samplers = [
            Sampler(
                lane,
                self._read_metrics,
                cfg.sample_interval,
                cfg.metrics_timeout,
                waiting_metric=cfg.queue_waiting_metric,
                running_metric=cfg.queue_running_metric,
            )
            for lane in self.lanes
        ]
        self._sampler_tasks = start_samplers(samplers)
        self._sampler_tasks += [
            asyncio.create_task(self._probe_health_forever(lane), name=f"health-{lane.index}")
            for lane in self.lanes
        ]

    async def stop(self) -> None:
        for task in self._sampler_tasks:
            task.cancel()
        if self._sampler_tasks:
            await asyncio.wait(self._sampler_tasks, timeout=1.0)
        self._sampler_tasks = []
        for session in (self.session, self.control):
            if session is not None:
                await session.close()
        self.session = self.control = None

    async def _read_metrics(self, lane: Lane) -> str | None:
        assert self.control is not None
        path = lane.url + self.config.backend_metrics_path
        query = metrics_query(self.config.queue_waiting_metric, self.config.queue_running_metric)
        async with self.control.get(URL(path + query, encoded=True)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {path} answered {resp.status}")
            return await resp.text()

    async def _health_ok(self, lane: Lane) -> bool:
        assert self.control is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        try:
            url = lane.url + self.config.backend_health_path
            async with self.control.get(url, timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def backend_health(self) -> list[bool]:
        """Whether each backend's health path answers 200 now (probed concurrently)."""
        return list(await asyncio.gather(*(self._health_ok(lane) for lane in self.lanes)))

    async def _probe_health_forever(self, lane: Lane) -> None:
        """Keep the lane's rotation state: out after failed probes, back at the first pass."""
        interval = self.config.health_interval
        while True:
            started = time.monotonic()
            try:
                ok = await self._health_ok(lane)
            except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
                raise
            except Exception:  # whatever broke the probe, the prober must live on
                ok = False
            was_in_rotation = lane.in_rotation
            lane.health_failures = 0 if ok else lane.health_failures + 1
            if was_in_rotation and not lane.in_rotation:
                self._cut_off_waiting(lane)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _cut_off_waiting(self, lane: Lane) -> None:
        """A lane just left rotation: the attempts still waiting for its answer to start are
        cancelled and retried on another lane (a wedged engine would hold them until the
        first-byte timeout). Not when no lane is left in rotation: there is nowhere better."""
        if not any(other.in_rotation for other in self.lanes):
            return
        for task in lane.awaiting:
            lane.cut_off.add(task)
            task.cancel()

    # -- the hot path ----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.stats
        stats.requests += 1
        status = await self._proxy(scope, receive, send)
        stats.statuses[status] += 1

    async def _answer(
        self, send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
    ) -> int:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        if extra:
            headers.extend(extra)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return status

    async def _overloaded(self, send: Send, retry_after: bytes | None, message: str) -> int:
        extra = [(b"retry-after", retry_after)] if retry_after else None
        body = _json_error(
            429,
            "rate_limit_exceeded",
            message,
            max_waiting_requests=self.config.max_waiting,
            endpoint=self.config.name,
        )
        return await self._answer(send, 429, body, extra)

    async def _read_body(
        self, scope: Scope, receive: Receive, send: Send
    ) -> bytes | bytearray | int:
        """The request body, or the status already answered (413, 429 when the bodies held
        fill the budget, 499 when the client left). The body's bytes stay counted in
        ``_buffered`` until the caller gives them back."""
        limit = self.config.max_body_bytes
        declared: int | None = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._answer(
                        send, 400, _json_error(400, "invalid_request_error", "bad Content-Length")
                    )
                if declared > limit:
                    return await self._too_large(send)
                break
        message = await receive()
        if message["type"] == "http.disconnect":
            return 499
        body: bytes = message.get("body", b"")
        size = len(body)
        if size > limit:
            return await self._too_large(send)
        if not message.get("more_body", False):
            if not self._reserve(size):
                return await self._buffer_full(send)
            return body
        # A long body: reserve what it declared before reading it, and fill one buffer in
        # place (a list of chunks joined at the end would hold the body twice).
        reserved = declared if declared is not None else size
        if not self._reserve(reserved):
            return await self._buffer_full(send)
        buffer = bytearray(reserved)
        buffer[:size] = body
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._buffered -= reserved
                return 499
            chunk = message.get("body", b"")
            end = size + len(chunk)
            if end > limit:
                self._buffered -= reserved
                return await self._too_large(send)
            if end > reserved:
                if declared is not None or not self._reserve(end - reserved):
                    self._buffered -= reserved
                    if declared is not None:  # the server framed more than declared
                        return await self._answer(
                            send, 400, _json_error(400, "invalid_request_error", "body too long")
                        )
                    return await self._buffer_full(send)
                reserved = end
            buffer[size:end] = chunk
            size = end
            if not message.get("more_body", False):
                if size < reserved:
                    del buffer[size:]
                    self._buffered -= reserved - size
                return buffer

    def _reserve(self, size: int) -> bool:
        if self._buffered + size > self.config.max_buffered_bytes:
            return False
        self._buffered += size
        return True

    async def _buffer_full(self, send: Send) -> int:
        self.stats.rejected_buffer_full += 1
        return await self._overloaded(
            send,
            self._retry_after,
            "the endpoint holds as many request bodies as it may (--max-buffered-bytes)",
        )

    async def _too_large(self, send: Send) -> int:
        self.stats.rejected_too_large += 1
        message = f"request body over {self.config.max_body_bytes} bytes (--max-body-bytes)"
        return await self._answer(send, 413, _json_error(413, "request_too_large", message))

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> int:
        target: bytes = scope.get("raw_path") or scope["path"].encode()
        if not target.startswith(b"/"):
            # An authority-like target (``@host:port/x``) glued to a backend URL names another
            # host; only origin-form targets are proxied, as path and query.
            return await self._answer(
                send, 400, _json_error(400, "invalid_request_error", BAD_TARGET.decode())
            )
        if scope.get("query_string"):
            target = target + b"?" + scope["query_string"]
        body = await self._read_body(scope, receive, send)
        if isinstance(body, int):
            return body
        # Watch for the client going away while we wait on a backend, so the lane is released.
        me = asyncio.current_task()
        gone = False
        finished = False

        async def watch() -> None:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not finished and me is not None:
                gone = True
                me.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await self._forward(scope, target.decode("latin-1"), body, send)
        except asyncio.CancelledError:
            if gone and me is not None and me.uncancel() == 0:
                self.stats.client_disconnects += 1
                return 499
            raise
        finally:
            finished = True
            watcher.cancel()
            self._buffered -= len(body)

    async def _forward(self, scope: Scope, path: str, body: bytes | bytearray, send: Send) -> int:
        session = self.session
        assert session is not None, "endpoint not started"
        stats = self.stats
        router = self.router
        gates = self._gates
        me = asyncio.current_task()
        assert me is not None
        method: str = scope["method"]
        headers = CIMultiDict(
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in _strip_hop_by_hop(scope["headers"], self._not_forwarded)
        )
        large = len(body) > BODY_SLICE
        if large:
            headers["Content-Length"] = str(len(body))
        urls = self._urls
        tried: list[Lane] = []
        first_overload_retry_after: bytes | None = None
        saw_overload = False
        last: _Buffered | None = None  # None after a connection failure
        failures: list[str] = []  # reasons; all but a final failure were retries
        for attempt in range(self._attempt_cap):
            lane = router.pick(time.monotonic(), tried)
            if lane is None:
                if attempt == 0:
                    stats.rejected_overload += 1
                    return await self._overloaded(
                        send, self._retry_after, "every backend is over its queue limit"
                    )
                # The untried lanes are over their queue limit: that is an overload too.
                saw_overload = True
                break
            tried.append(lane)
            stats.attempts += 1
            lane.requests += 1
            lane.active += 1
            gate = gates[lane.index]
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
            try:
                url = urls.get((lane.index, path))
                if url is None:
                    url = URL(lane.url + path, encoded=True)
                    if len(urls) < 4096:
                        urls[lane.index, path] = url
                lane.awaiting.add(me)
                try:
                    resp = await session.request(
                        method,
                        url,
                        data=_slices(body) if large else body,
                        headers=headers,
                        allow_redirects=False,
                    )
                except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                    last = None
                    failures.append("timeout" if isinstance(exc, TimeoutError) else "connect")
                    continue
                except asyncio.CancelledError:
                    if me not in lane.cut_off:
                        raise
                    lane.cut_off.discard(me)
                    if me.uncancel() > 0:
                        raise  # cancelled for another reason too (the client left)
                    last = None
                    failures.append("unhealthy")
                    continue
                finally:
                    lane.awaiting.discard(me)
                try:
                    status = resp.status
                    if status in RETRY_STATUSES:
                        raw = list(resp.raw_headers)
                        try:
                            data = await resp.read()
                        except (aiohttp.ClientError, TimeoutError):
                            data = b""
                        last = _Buffered(status, raw, data)
                        if status == 429:
                            saw_overload = True
                            if first_overload_retry_after is None:
                                first_overload_retry_after = _retry_after_of(raw)
                        failures.append(str(status))
                        continue
                    small = resp.content_length is not None and resp.content_length <= SMALL_BODY
                    if small:
                        # Read before answering: until the first byte goes out, a backend
                        # that breaks mid-body can still be retried on another lane.
                        try:
                            data = await resp.read()
                        except (aiohttp.ClientError, TimeoutError):
                            last = None
                            failures.append("broken")
                            continue
                    for reason in failures:
                        stats.retries[reason] += 1
                    if small:
                        headers_out = _strip_hop_by_hop(resp.raw_headers, HOP_BY_HOP)
                        await send(
                            {
                                "type": "http.response.start",
                                "status": status,
                                "headers": headers_out,
                            }
                        )
                        await send({"type": "http.response.body", "body": data})
                        return status
                    return await self._relay(resp, send)
                finally:
                    resp.release()
            finally:
                gate.release()
                lane.active -= 1
        # Out of attempts (or of admitted lanes): the last failure decides the answer.
        for reason in failures[:-1]:
            stats.retries[reason] += 1
        if last is None:
            if saw_overload:
                retry_after = first_overload_retry_after or self._retry_after
                return await self._overloaded(
                    send, retry_after, "backends overloaded or unreachable; retry later"
                )
            return await self._answer(
                send, 502, _json_error(502, "bad_gateway", "backend unavailable")
            )
        out = _strip_hop_by_hop(last.headers, HOP_BY_HOP)
        if last.status == 429 and _retry_after_of(out) is None:
            retry_after = first_overload_retry_after or self._retry_after
            if retry_after:
                out.append((b"retry-after", retry_after))
        out = [(k, v) for k, v in out if k != b"content-length"]
        out.append((b"content-length", b"%d" % len(last.body)))
        await send({"type": "http.response.start", "status": last.status, "headers": out})
        await send({"type": "http.response.body", "body": last.body})
        return last.status

    async def _relay(self, resp: aiohttp.ClientResponse, send: Send) -> int:
        """Stream a non-retryable upstream response to the client; no retry after this point."""
        headers = _strip_hop_by_hop(resp.raw_headers, HOP_BY_HOP)
        status = resp.status
        await send({"type": "http.response.start", "status": status, "headers": headers})
        connection = resp.connection
        if connection is not None and connection.protocol is not None:
            # The answer has begun: from here on a gap is the stream's idle timeout.
            connection.protocol.read_timeout = self.config.read_timeout
            connection.protocol.start_timeout()
        try:
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError):
            self.stats.broken_streams += 1
            raise
        await send({"type": "http.response.body", "body": b""})
        return status


def build_app(config: EndpointConfig) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The endpoint's ASGI app: the raw proxy plus starlette ``/health`` and ``/metrics``.

    The returned callable handles the ASGI lifespan itself (pooled session and samplers start on
    startup and stop on shutdown); its ``endpoint`` attribute exposes lanes and counters.
    """
    endpoint = Endpoint(config)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(endpoint))

    async def health(request: Request) -> Response:
        ready = await endpoint.backend_health()
        payload = {"backends_ready": sum(ready), "backends": len(ready)}
        return JSONResponse(payload, status_code=200 if all(ready) else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    control = Starlette(routes=[Route("/health", health), Route("/metrics", metrics)])
    expected = config.token.get_secret_value().encode() if config.token is not None else None

    def authorized(scope: Scope) -> bool:
        if scope["path"] == "/health" and scope["method"] == "GET":
            return True  # readiness probes carry no credentials
        for key, value in scope["headers"]:
            if key == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                # the scheme is case-insensitive (RFC 9110); the token is compared in constant time
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    credentials.strip(), expected or b""
                )
        return False

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if expected is not None and not authorized(scope):
                endpoint.stats.rejected_unauthorized += 1
                body = _json_error(401, "unauthorized", "missing or wrong bearer token")
                await endpoint._answer(
                    send, 401, body, [(b"www-authenticate", b'Bearer realm="slurmgate"')]
                )
            elif scope["path"] in CONTROL_PATHS and scope["method"] in ("GET", "HEAD"):
                await control(scope, receive, send)
            else:
                await endpoint(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        await endpoint.start()
                    except Exception as exc:
                        await send({"type": "lifespan.startup.failed", "message": str(exc)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await endpoint.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    app.endpoint = endpoint  # type: ignore[attr-defined]
    return app


async def serve(config: EndpointConfig, sock: socket.socket | None = None) -> None:
    """Serve the endpoint until SIGTERM/SIGINT (or cancellation); returns after a clean stop."""
    from slurmgate.serving import quiet_server

    server = quiet_server(
        build_app(config),
        host=config.host,
        port=config.port,
        lifespan="on",
        server_header=False,
        date_header=False,
        backlog=4096,
    )
    loop = asyncio.get_running_loop()
    if sock is not None:
        # Accepted sockets inherit it on Linux; asyncio sets it only when proto says TCP.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stop() -> None:
        server.should_exit = True

    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
    await server.serve(sockets=[sock] if sock is not None else None)
    if not server.started:
        raise SystemExit(1)


def main(argv: list[str] | None = None, prog: str = DEFAULT_PROG) -> None:
    """Parse the flags, then serve until SIGTERM (`python -m slurmgate.runtime.endpoint`)."""
    config = parse_config(argv, prog=prog)
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvicorn[standard] ships uvloop
        factory = None
    print(
        f"endpoint {config.name}: listening on {config.host}:{config.port}, "
        f"{len(config.backends)} backend(s)",
        file=sys.stderr,
        flush=True,
    )
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(config))
