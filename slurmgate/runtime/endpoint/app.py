"""The logical endpoint of one deployment: route, retry and stream requests to its lane heads.

Run it as ``python -m slurmgate.runtime.endpoint --name D --listen HOST:PORT --backend URL ...``
or ``slurmgate endpoint`` with the same flags (``config.py`` holds them).
Every request arrives through the data plane (``dataplane.py``: HTTP/1.1 on raw asyncio
protocols and httptools, both to the client and to the lanes, ``upstream.py``) on the one port;
``/health`` and ``/metrics`` are starlette routes it calls as ASGI, and the lanes' scrapes and
health probes go through a small aiohttp session of their own. Chosen by measurement with wrk
against the DataDesigner proxy (``benchmarks/bench_endpoint.py``,
``benchmarks/results/endpoint.md``): uvicorn + ASGI downstream and aiohttp upstream cost
0.70-0.78x the peer's CPU per request, this data plane 0.19-0.30x, with the same routing, retry
and limit code.

Routing is least-active with a rotating cursor for ties (``routing.py``), gated per lane by the
sampled queue depth (``backpressure.py``) and by the lane's health probes, which take a failing
lane out of rotation. A request is tried on at most ``max_attempts`` distinct backends; it is
retried when the connection to a lane could not be made, when a reused idle connection died
before any byte of the answer (the lane closed it as it was reused; once per request), on the
first-byte timeout, on 429 and 500/502/503/504, and when its lane leaves rotation before
answering. A request that was sent whole and then dropped, or whose answer broke off, is not
retried (502): it may be what killed its lane, and re-sent it would kill every replica.

Each lane has ``pool_size // lanes`` upstream connections; a request that waits for one is held
here and counts as waiting in the lane's queue. Request bodies are kept whole (a retry needs
them) and all of them together stay under ``max_buffered_bytes``. With a token in
``$SLURMGATE_ENDPOINT_TOKEN`` every request but ``GET /health`` must carry it as a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import resource
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httptools
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from yarl import URL

from slurmgate.errors import ExternalError
from slurmgate.runtime.endpoint import pd
from slurmgate.runtime.endpoint.backpressure import (
    Lane,
    QueuePolicy,
    Sampler,
    metrics_query,
    start_samplers,
)
from slurmgate.runtime.endpoint.breaker import Breaker
from slurmgate.runtime.endpoint.config import DEFAULT_PROG, EndpointConfig, parse_config
from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming, asgi_scope
from slurmgate.runtime.endpoint.routing import LeastActiveRouter
from slurmgate.runtime.endpoint.upstream import LanePool, UpstreamConnection, UpstreamError

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
# Set by the data plane itself: forwarding them would be wrong (Host) or duplicated.
NOT_FORWARDED_UP = HOP_BY_HOP | {b"host", b"content-length"}
NOT_FORWARDED_DOWN = HOP_BY_HOP | {b"content-length"}
NO_BODY_METHODS = frozenset({b"GET", b"HEAD", b"DELETE", b"OPTIONS", b"TRACE"})
SMALL_BODY = 64 * 1024
CONTROL_PATHS_B = frozenset({b"/health", b"/metrics"})
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
    rejected_body_timeout: int = 0
    rejected_head: int = 0  # heads the data plane refused: malformed, too large
    rejected_connections: int = 0  # connections answered 503 past --max-connections
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
            "slurmgate_endpoint_body_timeouts",
            "408s for request bodies not in within --body-timeout",
            stats.rejected_body_timeout,
        )
        yield counter(
            "slurmgate_endpoint_bad_heads",
            "400s, 414s and 431s for malformed or oversized request heads",
            stats.rejected_head,
        )
        yield counter(
            "slurmgate_endpoint_refused_connections",
            "Connections answered 503 because --max-connections were open",
            stats.rejected_connections,
        )
        open_now = GaugeMetricFamily(
            "slurmgate_endpoint_open_connections", "Client connections open", labels=["endpoint"]
        )
        open_now.add_metric([name], ep.open_connections())
        yield open_now
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
        breaker_open = GaugeMetricFamily(
            "slurmgate_backend_breaker_open",
            "1 while the lane's circuit breaker keeps it out (open or probing)",
            labels=labels,
        )
        trips = CounterMetricFamily(
            "slurmgate_backend_breaker_trips", "Times the lane's breaker opened", labels=labels
        )
        for lane in ep.lanes:
            key = [name, lane.url]
            breaker_open.add_metric(key, 1.0 if lane.breaker.tripped else 0.0)
            trips.add_metric(key, lane.breaker.trips)
            overdue.add_metric(key, lane.samples_overdue)
            queued.add_metric(key, lane.queued)
            rotation.add_metric(key, 1.0 if lane.in_rotation else 0.0)
            active.add_metric(key, lane.active)
            routed.add_metric(key, lane.requests)
            depth.add_metric(key, float("nan") if lane.depth is None else lane.depth)
            admitted.add_metric(key, 1.0 if ep.policy.admits(lane, now) else 0.0)
            failed.add_metric(key, lane.samples_failed)
        yield from (active, routed, depth, admitted, failed, overdue, queued, rotation)
        yield from (breaker_open, trips)


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


def _json_error(status: int, kind: str, message: str, **extra: Any) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": status, **extra}}
    ).encode()


class Endpoint:
    """The proxy's state and its request handler (the data plane's ``Handler``)."""

    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        roles: list[tuple[str, str | None, int | None]] = [
            (url, None, None) for url in config.backends
        ]
        roles += [(p.url, "prefill", p.bootstrap_port) for p in config.prefill]
        roles += [(url, "decode", None) for url in config.decode]
        self.lanes = [
            Lane(
                index=i,
                url=url,
                role=role,
                bootstrap_port=boot,
                breaker=Breaker(config.breaker_failures, config.breaker_open_s),
            )
            for i, (url, role, boot) in enumerate(roles)
        ]
        self.policy = QueuePolicy(max_waiting=config.max_waiting, stale_after=config.stale_after)
        self.pd = config.disaggregated
        if self.pd:
            # One router per role; requests that are not a JSON body go to the decode lanes.
            self.prefill_router = LeastActiveRouter(
                [lane for lane in self.lanes if lane.role == "prefill"], self.policy
            )
            self.router = LeastActiveRouter(
                [lane for lane in self.lanes if lane.role == "decode"], self.policy
            )
        else:
            self.router = LeastActiveRouter(self.lanes, self.policy)
        self.stats = EndpointStats()
        self.pools: list[LanePool] = []  # the data plane's upstream connections, one per lane
        # Scrapes and health probes get their own small pool: when traffic fills the proxy
        # pool, which is exactly when backpressure matters, they must not queue behind it.
        self.control: aiohttp.ClientSession | None = None
        self._sampler_tasks: list[asyncio.Task[None]] = []
        self._retry_after = config.retry_after_header
        # One gate per lane, the size of its share of the pool: a request waiting at the gate
        # is visible (``lane.queued``), and counts as waiting in the lane's queue.
        self._per_lane = max(1, config.pool_size // len(self.lanes))
        self._gates = [asyncio.Semaphore(self._per_lane) for _ in self.lanes]
        self._buffered = 0  # bytes of request bodies held now, over all requests
        self._not_forwarded = NOT_FORWARDED_UP | (
            {b"authorization"} if config.token is not None else frozenset()
        )
        self._attempt_cap = min(config.max_attempts, len(self.router.lanes))
        self.max_body_bytes = config.max_body_bytes
        self.connections: set[ClientConnection] = set()  # the clients', kept by the data plane
        self._hosts = [lane.url.removeprefix("http://").encode() for lane in self.lanes]
        # a prefill lane's bootstrap_host: its URL's host, as sglang-router injects it
        self._bootstrap_hosts = [urlsplit(lane.url).hostname or "" for lane in self.lanes]
        self._expected = config.token.get_secret_value().encode() if config.token else None
        self._control_app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self.pools = [
            LanePool(parts.hostname or "", parts.port or 80, cfg.keepalive_timeout)
            for parts in (urlsplit(lane.url) for lane in self.lanes)
        ]
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
        for pool in self.pools:
            pool.close()
        if self.control is not None:
            await self.control.close()
        self.control = None

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

    # -- what the data plane asks (dataplane.Handler) -------------------------------------

    def reserve(self, size: int) -> bool:
        if self._buffered + size > self.config.max_buffered_bytes:
            return False
        self._buffered += size
        return True

    def release(self, size: int) -> None:
        self._buffered -= size

    def open_connections(self) -> int:
        return len(self.connections)

    def refused(self, status: int) -> None:
        if status == 503:
            self.stats.rejected_connections += 1
        else:
            self.stats.rejected_head += 1
        self.stats.statuses[status] += 1

    def admit(self, conn: ClientConnection, req: Incoming) -> bool:
        """Judge a request by its head: answer it at once, or let its body come."""
        target = req.target
        if target[:1] != b"/" and target[:7].lower() == b"http://":
            # absolute-form: only its path and query are ours to proxy (RFC 9112, 3.2.2)
            try:
                url = httptools.parse_url(target)
            except httptools.HttpParserInvalidURLError:
                url = None
            if url is not None and url.path:
                target = req.target = url.path + (b"?" + url.query if url.query else b"")
        expected = self._expected
        if expected is not None and not self._authorized(req):
            self.stats.rejected_unauthorized += 1
            body = _json_error(401, "unauthorized", "missing or wrong bearer token")
            self._answer(conn, req, 401, body, [(b"www-authenticate", b'Bearer realm="slurmgate"')])
            return False
        if req.method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] in CONTROL_PATHS_B:
            if req.declared or any(key == b"transfer-encoding" for key, _ in req.headers):
                message = f"{req.method.decode()} {target.split(b'?', 1)[0].decode()} takes no body"
                body = _json_error(400, "invalid_request_error", message)
                self.stats.statuses[self._answer(conn, req, 400, body)] += 1
                return False
            return True
        self.stats.requests += 1
        if not target.startswith(b"/"):
            # An authority-like target (``@host:port/x``) glued to a backend URL names another
            # host; only origin-form targets are proxied, as path and query.
            body = _json_error(400, "invalid_request_error", BAD_TARGET.decode())
            self.stats.statuses[self._answer(conn, req, 400, body)] += 1
            return False
        # A length over --max-body-bytes was refused before it came here; the body joins the
        # budget as it arrives, never as declared.
        if req.declared is not None and req.declared < 0:
            body = _json_error(400, "invalid_request_error", "bad Content-Length")
            self.stats.statuses[self._answer(conn, req, 400, body)] += 1
            return False
        return True

    def _authorized(self, req: Incoming) -> bool:
        if req.method == b"GET" and req.target.split(b"?", 1)[0] == b"/health":
            return True  # readiness probes carry no credentials
        for key, value in req.headers:
            if key == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                # the scheme is case-insensitive (RFC 9110); the token is compared in constant time
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    credentials.strip(), self._expected or b""
                )
        return False

    def too_large(self, conn: ClientConnection, req: Incoming) -> None:
        self.stats.rejected_too_large += 1
        message = f"request body over {self.config.max_body_bytes} bytes (--max-body-bytes)"
        self.stats.statuses[
            self._answer(conn, req, 413, _json_error(413, "request_too_large", message))
        ] += 1

    def buffer_full(self, conn: ClientConnection, req: Incoming) -> None:
        self.stats.rejected_buffer_full += 1
        status = self._overloaded(
            conn,
            req,
            self._retry_after,
            "the endpoint holds as many request bodies as it may (--max-buffered-bytes)",
        )
        self.stats.statuses[status] += 1

    def body_timed_out(self, conn: ClientConnection, req: Incoming) -> None:
        self.stats.rejected_body_timeout += 1
        message = (
            f"request body not complete within {self.config.body_timeout:g} s (--body-timeout)"
        )
        self.stats.statuses[
            self._answer(conn, req, 408, _json_error(408, "request_timeout", message))
        ] += 1

    def dispatch(self, conn: ClientConnection, req: Incoming) -> None:
        """The whole request is in: proxy it, or hand a control route to starlette."""
        path, _, query = req.target.partition(b"?")
        if req.method in (b"GET", b"HEAD") and path in CONTROL_PATHS_B:
            req.task = asyncio.create_task(self._control(conn, req, path.decode(), query))
        else:
            req.task = asyncio.create_task(self._handle(conn, req))

    # -- answers ---------------------------------------------------------------------------

    def _answer(
        self,
        conn: ClientConnection,
        req: Incoming,
        status: int,
        body: bytes,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> int:
        headers = [(b"content-type", b"application/json")]
        if extra:
            headers.extend(extra)
        conn.send_full(req, status, headers, body)
        return status

    def _overloaded(
        self, conn: ClientConnection, req: Incoming, retry_after: bytes | None, message: str
    ) -> int:
        extra = [(b"retry-after", retry_after)] if retry_after else None
        body = _json_error(
            429,
            "rate_limit_exceeded",
            message,
            max_waiting_requests=self.config.max_waiting,
            endpoint=self.config.name,
        )
        return self._answer(conn, req, 429, body, extra)

    async def _control(
        self, conn: ClientConnection, req: Incoming, path: str, query: bytes
    ) -> None:
        """/health and /metrics: starlette routes, called as ASGI with the whole request."""
        app = self._control_app
        assert app is not None, "endpoint not started"
        head: dict[str, Any] = {}
        chunks: list[bytes] = []
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(req.body), "more_body": False}
            await asyncio.Event().wait()  # nothing more comes; the app is cancelled if need be
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                head.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await app(asgi_scope(req, path, query), receive, send)
        except Exception as exc:  # a control route must answer, whatever broke
            head = {"status": 500, "headers": [(b"content-type", b"text/plain")]}
            chunks = [f"{type(exc).__name__}".encode()]
        finally:
            conn.finish_request(req)
        headers = [
            (k.lower(), v) for k, v in head.get("headers", []) if k.lower() != b"content-length"
        ]
        conn.send_full(req, head.get("status", 500), headers, b"".join(chunks))

    # -- the hot path ----------------------------------------------------------------------

    async def _handle(self, conn: ClientConnection, req: Incoming) -> None:
        stats = self.stats
        try:
            if self.pd and req.method == b"POST":
                status = await self._forward_pd(conn, req)
            else:
                status = await self._forward(conn, req)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if req.gone and me is not None and me.uncancel() == 0:
                stats.client_disconnects += 1
                stats.statuses[499] += 1
                return
            raise
        except BrokenStream:
            stats.broken_streams += 1
            conn.abort()
            return
        finally:
            conn.finish_request(req)
        stats.statuses[status] += 1

    def _request_head(self, req: Incoming, size: int | None = None) -> tuple[bytes, bytes]:
        """The upstream request's head, around the lane's host: (before, after); ``size`` is
        the body's length when the endpoint rewrote it."""
        headers = _strip_hop_by_hop(req.headers, self._not_forwarded)
        lines = b"".join([b"%s: %s\r\n" % pair for pair in headers])
        if size is not None:
            lines += b"content-length: %d\r\n" % size
        elif req.size or req.method not in NO_BODY_METHODS:
            lines += b"content-length: %d\r\n" % req.size
        return req.method + b" " + req.target + b" HTTP/1.1\r\nhost: ", b"\r\n" + lines + b"\r\n"

    async def _forward(self, conn: ClientConnection, req: Incoming) -> int:
        stats = self.stats
        router = self.router
        gates = self._gates
        pools = self.pools
        hosts = self._hosts
        cfg = self.config
        me = asyncio.current_task()
        assert me is not None
        before, after = self._request_head(req)
        body = req.body
        tried: list[Lane] = []
        first_overload_retry_after: bytes | None = None
        saw_overload = False
        last: _Buffered | None = None  # None after a connection failure
        failures: list[str] = []  # reasons; all but a final failure were retries
        dropped = False  # a lane dropped the request after it was sent: no more attempts
        stale_retried = False
        for attempt in range(self._attempt_cap):
            lane = router.pick(time.monotonic(), tried)
            if lane is None:
                if attempt == 0:
                    stats.rejected_overload += 1
                    return self._overloaded(
                        conn, req, self._retry_after, "every backend is over its queue limit"
                    )
                # The untried lanes are over their queue limit: that is an overload too.
                saw_overload = True
                break
            tried.append(lane)
            stats.attempts += 1
            gate = gates[lane.index]
            await _enter(lane, gate)
            pool = pools[lane.index]
            upstream: UpstreamConnection | None = None
            outcome: bool | None = None  # for the lane's breaker: answered well, or failed
            try:
                lane.awaiting.add(me)
                try:
                    upstream = await pool.acquire(cfg.connect_timeout)
                    await upstream.send(
                        before + hosts[lane.index] + after, body, cfg.first_byte_timeout
                    )
                except (OSError, TimeoutError, UpstreamError) as exc:
                    last = None
                    if upstream is None:
                        failures.append("connect")  # nothing was sent
                        outcome = False
                        continue
                    if isinstance(exc, TimeoutError):
                        failures.append("timeout")  # no answer began within its time
                        outcome = False
                        continue
                    if upstream.reused and not upstream.received and not stale_retried:
                        # the lane closed its idle connection as it was reused: a known race
                        stale_retried = True
                        failures.append("stale")
                        continue
                    failures.append("dropped")
                    dropped, outcome = True, False
                    break
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
                status = upstream.status
                outcome = status < 500  # a 4xx is the client's fault, or the lane being busy
                if status in RETRY_STATUSES:
                    try:
                        data = await upstream.read_all()
                    except (OSError, TimeoutError, UpstreamError):
                        data = b""
                    last = _Buffered(status, upstream.headers, data)
                    if status == 429:
                        saw_overload = True
                        if first_overload_retry_after is None:
                            first_overload_retry_after = _retry_after_of(upstream.headers)
                    failures.append(str(status))
                    continue
                length = upstream.content_length
                small = length is not None and length <= SMALL_BODY and not req.head_only
                if small:
                    # Read before answering: until the first byte goes out, a backend that
                    # breaks mid-body can still be retried on another lane.
                    try:
                        data = await upstream.read_all()
                    except (OSError, TimeoutError, UpstreamError):
                        last = None
                        failures.append("broken")
                        dropped, outcome = True, False
                        break
                for reason in failures:
                    stats.retries[reason] += 1
                headers = _response_headers(upstream.headers)
                if small:
                    conn.send_full(req, status, headers, data)
                    return status
                try:
                    return await self._relay(conn, req, upstream, status, headers)
                except BrokenStream:
                    outcome = False
                    raise
            finally:
                if outcome is None:
                    lane.breaker.abandoned()
                else:
                    lane.breaker.record(outcome, time.monotonic())
                if upstream is not None:
                    pool.release(upstream)
                gate.release()
                lane.active -= 1
        # Out of attempts (or of admitted lanes): the last failure decides the answer.
        for reason in failures[:-1]:
            stats.retries[reason] += 1
        if dropped:
            message = (
                "the backend dropped the request after it was sent; not retried, since the "
                "request itself may have broken it"
            )
            return self._answer(conn, req, 502, _json_error(502, "bad_gateway", message))
        if last is None:
            if saw_overload:
                retry_after = first_overload_retry_after or self._retry_after
                self._overloaded(
                    conn, req, retry_after, "backends overloaded or unreachable; retry later"
                )
                return 429
            return self._answer(
                conn, req, 502, _json_error(502, "bad_gateway", "backend unavailable")
            )
        out = _response_headers(last.headers)
        if last.status == 429 and _retry_after_of(out) is None:
            retry_after = first_overload_retry_after or self._retry_after
            if retry_after:
                out.append((b"retry-after", retry_after))
        conn.send_full(req, last.status, out, last.body)
        return last.status

    async def _relay(
        self,
        conn: ClientConnection,
        req: Incoming,
        upstream: UpstreamConnection,
        status: int,
        headers: list[tuple[bytes, bytes]],
    ) -> int:
        """Stream a non-retryable upstream answer to the client; no retry after this point."""
        conn.send_head(req, status, headers, upstream.content_length)

        def sink(data: bytes) -> None:
            conn.send_chunk(req, data)

        conn.feeder = upstream
        if conn.write_paused:
            upstream.pause()
        try:
            # The answer has begun: from here on a gap is the stream's idle timeout.
            await upstream.stream(sink, self.config.read_timeout)
        except (OSError, TimeoutError, UpstreamError) as exc:
            raise BrokenStream("the backend broke mid-answer") from exc
        finally:
            conn.feeder = None
        conn.send_end(req)
        return status

    # -- disaggregated: one prefill and one decode lane per request -------------------------

    async def _open_leg(
        self, conn: ClientConnection, req: Incoming, router: LeastActiveRouter, role: str
    ) -> _Leg | int:
        """A connection to the least active admitted lane of one role, or the status answered.

        Only a connection that could not be made moves on to another lane of the role (nothing
        was sent yet); every other failure happens after the pairing was fixed.
        """
        cfg = self.config
        stats = self.stats
        tried: list[Lane] = []
        failures: list[str] = []
        for _ in range(min(cfg.max_attempts, len(router.lanes))):
            lane = router.pick(time.monotonic(), tried)
            if lane is None:
                break
            tried.append(lane)
            stats.attempts += 1
            gate = self._gates[lane.index]
            await _enter(lane, gate)
            try:
                upstream = await self.pools[lane.index].acquire(cfg.connect_timeout)
            except (OSError, TimeoutError):
                failures.append("connect")
                lane.breaker.record(False, time.monotonic())
                gate.release()
                lane.active -= 1
                continue
            except BaseException:
                lane.breaker.abandoned()
                gate.release()
                lane.active -= 1
                raise
            for reason in failures:
                stats.retries[reason] += 1
            return _Leg(lane, upstream)
        for reason in failures[:-1]:
            stats.retries[reason] += 1
        if not tried:
            stats.rejected_overload += 1
            return self._overloaded(
                conn, req, self._retry_after, f"every {role} backend is over its queue limit"
            )
        message = f"no {role} backend could be reached"
        return self._answer(conn, req, 502, _json_error(502, "bad_gateway", message))

    async def _send_leg(self, leg: _Leg, head: bytes, body: bytes) -> None:
        """Send the paired body on a leg's connection; a reused connection the lane had closed
        (before any byte of the answer) is replaced once by a new one to the same lane, so the
        pairing holds. A leg interrupted by its partner's failure raises ``PartnerFailed``."""
        cfg = self.config
        assert leg.upstream is not None
        try:
            await leg.upstream.send(head, body, cfg.first_byte_timeout)
        except (OSError, UpstreamError):
            upstream = leg.upstream
            if not (upstream.reused and not upstream.received) or leg.retried or leg.interrupted:
                raise
            leg.retried = True
            self.stats.retries["stale"] += 1
            pool = self.pools[leg.lane.index]
            pool.release(upstream)
            leg.upstream = None
            leg.upstream = await pool.acquire(cfg.connect_timeout)
            if leg.interrupted:  # the partner failed while this leg reconnected
                raise PartnerFailed() from None
            await leg.upstream.send(head, body, cfg.first_byte_timeout)

    def _close_leg(self, leg: _Leg, outcome: bool | None) -> None:
        lane = leg.lane
        if outcome is None:
            lane.breaker.abandoned()
        else:
            lane.breaker.record(outcome, time.monotonic())
        if leg.upstream is not None:
            self.pools[lane.index].release(leg.upstream)
        self._gates[lane.index].release()
        lane.active -= 1

    async def _prefill(self, leg: _Leg, head: bytes, body: bytes) -> _Buffered:
        await self._send_leg(leg, head, body)
        assert leg.upstream is not None
        return _Buffered(leg.upstream.status, leg.upstream.headers, await leg.upstream.read_all())

    async def _forward_pd(self, conn: ClientConnection, req: Incoming) -> int:
        """Pair a prefill and a decode lane, send both the request with SGLang's bootstrap
        fields, and answer with the decode's answer (streamed as it comes).

        The prefill runs in a task of its own; the decode is awaited here. A prefill that fails
        (an error, or an answer that is not 2xx) interrupts the decode's wait from the task's
        done-callback, so the request never waits on a decode that waits in vain for its
        bootstrap room; the prefill's answer (or a 502) is then the request's.
        """
        request = pd.json_object(req.body)
        if request is None:
            return await self._forward(conn, req)  # not a generation request: a decode answers
        prefill = await self._open_leg(conn, req, self.prefill_router, "prefill")
        if isinstance(prefill, int):
            return prefill
        p_outcome: bool | None = None
        d_outcome: bool | None = None
        decode: _Leg | int | None = None
        prefilling: asyncio.Task[_Buffered] | None = None
        try:
            decode = await self._open_leg(conn, req, self.router, "decode")
            if isinstance(decode, int):
                return decode
            index = prefill.lane.index
            try:
                body, _ = pd.paired_body(
                    req.body, request, self._bootstrap_hosts[index], prefill.lane.bootstrap_port
                )
            except ValueError as exc:
                message = f"cannot pair the request: {exc}"
                return self._answer(
                    conn, req, 400, _json_error(400, "invalid_request_error", message)
                )
            before, after = self._request_head(req, len(body))
            prefilling = asyncio.create_task(
                self._prefill(prefill, before + self._hosts[index] + after, body)
            )
            prefilling.add_done_callback(functools.partial(_interrupt_on_failure, decode))
            decode_head = before + self._hosts[decode.lane.index] + after
            decode_error: BaseException | None = None
            try:
                await self._send_leg(decode, decode_head, body)
            except (OSError, TimeoutError, UpstreamError, PartnerFailed) as exc:
                decode_error = exc
            if decode_error is None or decode.interrupted:
                # the decode's head is in (or the prefill cut it off): the prefill decides
                try:
                    prefilled = await prefilling
                except (OSError, TimeoutError, UpstreamError) as exc:
                    p_outcome = False
                    return self._leg_failed(conn, req, "prefill", exc)
                p_outcome = prefilled.status < 500
                if not 200 <= prefilled.status < 300:
                    # the prefill refused it: its answer is the request's
                    out = _response_headers(prefilled.headers)
                    conn.send_full(req, prefilled.status, out, prefilled.body)
                    return prefilled.status
            if decode_error is not None:
                d_outcome = False
                return self._leg_failed(conn, req, "decode", decode_error)
            upstream = decode.upstream
            assert upstream is not None
            status = upstream.status
            d_outcome = status < 500
            headers = _response_headers(upstream.headers)
            length = upstream.content_length
            if length is not None and length <= SMALL_BODY and not req.head_only:
                try:
                    data = await upstream.read_all()
                except (OSError, TimeoutError, UpstreamError):
                    d_outcome = False
                    message = "the decode backend broke off its answer; not retried"
                    return self._answer(conn, req, 502, _json_error(502, "bad_gateway", message))
                conn.send_full(req, status, headers, data)
                return status
            try:
                return await self._relay(conn, req, upstream, status, headers)
            except BrokenStream:
                d_outcome = False
                raise
        finally:
            if prefilling is not None:
                if not prefilling.done():
                    prefilling.cancel()
                    await asyncio.wait([prefilling])  # its connection is quiet before release
                if not prefilling.cancelled():
                    prefilling.exception()  # retrieved: a failure was answered above
            self._close_leg(prefill, p_outcome)
            if isinstance(decode, _Leg):
                self._close_leg(decode, d_outcome)

    def _leg_failed(
        self, conn: ClientConnection, req: Incoming, role: str, error: BaseException
    ) -> int:
        reason = "timeout" if isinstance(error, TimeoutError) else "dropped"
        message = f"the {role} backend failed before answering ({reason}); not retried"
        return self._answer(conn, req, 502, _json_error(502, "bad_gateway", message))


async def _enter(lane: Lane, gate: asyncio.Semaphore) -> None:
    """Count a request on its lane and take the lane's gate, counted as queued while it waits."""
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


def _interrupt_on_failure(decode: _Leg, prefilling: asyncio.Task[_Buffered]) -> None:
    """The prefill task's done-callback: a failed prefill cuts its decode's wait short."""
    if prefilling.cancelled():
        return
    error = prefilling.exception()
    if error is None and 200 <= prefilling.result().status < 300:
        return
    decode.interrupted = True
    if decode.upstream is not None:
        decode.upstream.abort(PartnerFailed())


class PartnerFailed(ExternalError):
    """The other leg of a disaggregated request failed: this leg's wait is cut short."""


@dataclass
class _Leg:
    """One side of a disaggregated request: its lane and connection."""

    lane: Lane
    upstream: UpstreamConnection | None
    retried: bool = False  # its stale-connection retry is spent
    interrupted: bool = False  # the other leg failed: this one is given up


class BrokenStream(ExternalError):
    """The backend broke after the answer had started: the client's connection is cut."""


def _response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An upstream answer's headers as forwarded: no hop-by-hop ones, no framing (the data
    plane frames the answer itself)."""
    return _strip_hop_by_hop(headers, NOT_FORWARDED_DOWN)


class EndpointServer:
    """The endpoint on its port: the data plane for every request, started and stopped here."""

    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self.endpoint = Endpoint(config)
        self.endpoint._control_app = _control_routes(self.endpoint)
        self.connections = self.endpoint.connections
        self.max_connections = config.max_connections
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self, sock: socket.socket | None = None) -> None:
        """Start the pools and samplers, then listen (on sock, or on the config's address)."""
        await self.endpoint.start()
        loop = asyncio.get_running_loop()
        cfg = self.config
        reserve = cfg.pool_size + 4 * len(cfg.all_backends) + FD_RESERVE
        fd_limit = raise_fd_limit(cfg.max_connections + reserve)
        self.max_connections = max(1, min(cfg.max_connections, fd_limit - reserve))
        if self.max_connections < cfg.max_connections:
            print(
                f"endpoint {cfg.name}: at most {self.max_connections} client connections, not "
                f"{cfg.max_connections} (--max-connections): the file-descriptor limit is "
                f"{fd_limit} and the lanes' pool needs {reserve}; raise `ulimit -n`",
                file=sys.stderr,
                flush=True,
            )
        limit = self.max_connections

        def factory() -> ClientConnection:
            return ClientConnection(self.endpoint, self.connections, limit)

        if sock is not None:
            # Accepted sockets inherit it on Linux; asyncio sets it only when proto says TCP.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._server = await loop.create_server(factory, sock=sock, backlog=4096)
        else:
            self._server = await loop.create_server(
                factory, self.config.host, self.config.port, backlog=4096, reuse_address=True
            )
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._close_idle_connections())

    async def _close_idle_connections(self) -> None:
        """Cut connections past a deadline (idle, head, lingering) and answer late bodies."""
        body_timeout = self.config.body_timeout
        tick = min(1.0, body_timeout / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.past_deadline(now, body_timeout):
                    conn.abort()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop listening, give requests in flight ``grace`` seconds, then cut the rest."""
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.active is None and conn.parsing is None:
                conn.abort()
        deadline = time.monotonic() + grace
        while any(c.active is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tasks = [
            c.active.task
            for c in self.connections
            if c.active is not None and c.active.task is not None and not c.active.task.done()
        ]
        for conn in list(self.connections):
            conn.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        await self.endpoint.stop()


# File descriptors the endpoint keeps for itself beside the clients' and the lanes' pool: the
# listener, the control session's scrapes and probes, stdio, the event loop's own.
FD_RESERVE = 32


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft file-descriptor limit towards ``wanted`` (up to the hard limit); returns
    the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft) if soft != resource.RLIM_INFINITY else wanted


def _control_routes(endpoint: Endpoint) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``/health`` and ``/metrics`` as starlette routes."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(endpoint))

    async def health(request: Request) -> Response:
        ready = await endpoint.backend_health()
        payload = {"backends_ready": sum(ready), "backends": len(ready)}
        return JSONResponse(payload, status_code=200 if all(ready) else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics)])


async def serve(config: EndpointConfig, sock: socket.socket | None = None) -> None:
    """Serve the endpoint until SIGTERM/SIGINT (or cancellation); returns after a clean stop."""
    server = EndpointServer(config)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
    try:
        await server.start(sock)
    except OSError as exc:
        print(f"endpoint {config.name}: cannot listen: {exc}", file=sys.stderr, flush=True)
        await server.endpoint.stop()
        raise SystemExit(1) from exc
    try:
        await stopping.wait()
    finally:
        await server.stop()


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
        f"{len(config.all_backends)} backend(s)"
        + (
            f" ({len(config.prefill)} prefill, {len(config.decode)} decode)"
            if config.disaggregated
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(config))
