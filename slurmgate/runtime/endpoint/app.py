"""The logical endpoint of one deployment: route, retry and stream requests to its lane heads.

Run it as ``python -m slurmgate.runtime.endpoint --name D --listen HOST:PORT --backend URL ...``
or ``slurmgate endpoint`` with the same flags (``config.py`` holds them).
Every request arrives through the data plane (``dataplane.py``: HTTP/1.1 on raw asyncio
protocols and httptools, both to the client and to the lanes, ``upstream.py``) on the one port;
``/health`` and ``/metrics`` are starlette routes it calls as ASGI (``control.py``), and the
lanes' scrapes and health probes go through a small aiohttp session of their own. Chosen by
measurement with wrk against the DataDesigner proxy (``benchmarks/bench_endpoint.py``,
``benchmarks/results/endpoint.md``): uvicorn + ASGI downstream and aiohttp upstream cost
0.70-0.78x the peer's CPU per request, this data plane 0.19-0.30x, with the same routing, retry
and limit code.

Routing is least-active with a rotating cursor for ties (``routing.py``), gated per lane by the
sampled queue depth (``backpressure.py``) and by the lane's health probes, which take a failing
lane out of rotation. A request goes the aggregated way (``aggregated.py``: tried on at most
``max_attempts`` lanes, each try one ``forward.Attempt``) or, with prefill and decode lanes, the
paired way (``disaggregated.py``), where every request is paired or refused (``pd.py``).

Each lane has ``pool_size // lanes`` upstream connections; a request that waits for one is held
here and counts as waiting in the lane's queue. Request bodies are kept whole (a retry needs
them) and all of them together stay under ``max_buffered_bytes``. With a token in
``$SLURMGATE_ENDPOINT_TOKEN`` every request but ``GET /health`` must carry it as a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable

import aiohttp
import httptools
from yarl import URL

from slurmgate.runtime.endpoint.aggregated import AggregatedPath
from slurmgate.runtime.endpoint.answers import answer, json_error, overloaded
from slurmgate.runtime.endpoint.backpressure import (
    Lane,
    QueuePolicy,
    Sampler,
    metrics_query,
    start_samplers,
)
from slurmgate.runtime.endpoint.breaker import Breaker
from slurmgate.runtime.endpoint.config import DEFAULT_PROG, EndpointConfig, parse_config
from slurmgate.runtime.endpoint.control import (
    CONTROL_PATHS_B,
    ASGIApp,
    answer_control,
    control_routes,
)
from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming
from slurmgate.runtime.endpoint.disaggregated import PairedPath
from slurmgate.runtime.endpoint.forward import BrokenStream, LaneLinks, Timeouts
from slurmgate.runtime.endpoint.haproxy import DataPlaneError, HAProxyPlane
from slurmgate.runtime.endpoint.heads import NOT_FORWARDED_UP
from slurmgate.runtime.endpoint.metrics import EndpointStats
from slurmgate.runtime.endpoint.routing import LeastActiveRouter

BAD_TARGET = b"request target must be a path starting with /"
ROLES = ("prefill", "decode")


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
        self.stats = EndpointStats()
        # Each lane's gate is the size of its share of the pool (``forward.LaneLinks``).
        per_lane = max(1, config.pool_size // len(self.lanes))
        self.links = LaneLinks(self.lanes, per_lane, Timeouts.of(config))
        not_forwarded = NOT_FORWARDED_UP | (
            {b"authorization"} if config.token is not None else frozenset()
        )
        self.pd = config.disaggregated
        # One router per role; with prefill and decode lanes, requests that are not a JSON
        # body go the aggregated way, to the decode lanes.
        by_role = {role: [lane for lane in self.lanes if lane.role == role] for role in ROLES}
        self.router = LeastActiveRouter(by_role["decode"] if self.pd else self.lanes, self.policy)
        self.aggregated = AggregatedPath(config, self.stats, self.router, self.links, not_forwarded)
        self.paired: PairedPath | None = None
        if self.pd:
            prefill_router = LeastActiveRouter(by_role["prefill"], self.policy)
            self.paired = PairedPath(
                config,
                self.stats,
                prefill_router,
                self.router,
                self.links,
                not_forwarded,
                self.aggregated,
            )
        # Scrapes and health probes get their own small pool: when traffic fills the proxy
        # pool, which is exactly when backpressure matters, they must not queue behind it.
        self.control: aiohttp.ClientSession | None = None
        self._sampler_tasks: list[asyncio.Task[None]] = []
        self._probed = asyncio.Event()  # every lane's health was probed once: /health answers
        self._retry_after = config.retry_after_header
        self._buffered = 0  # bytes of request bodies held now, over all requests
        # every body of a PD deployment is parsed to be paired: it has a limit of its own
        self.body_limit_flag = "--max-body-bytes"
        self.max_body_bytes = config.max_body_bytes
        if self.pd and config.max_pd_body_bytes < config.max_body_bytes:
            self.body_limit_flag = "--max-pd-body-bytes"
            self.max_body_bytes = config.max_pd_body_bytes
        self.connections: set[ClientConnection] = set()  # the clients', kept by the data plane
        self._expected = config.token.get_secret_value().encode() if config.token else None
        self._control_app: ASGIApp | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        if self.paired is not None:
            self.paired.start()
        self.links.open_pools(self.lanes, cfg.keepalive_timeout)
        self.control = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2 * len(self.lanes) + 8),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        samplers = [
            Sampler(
                lane,
                self._read_metrics,
                interval=cfg.sample_interval,
                timeout=cfg.metrics_timeout,
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
        self.links.close_pools()
        if self.paired is not None:
            self.paired.close()
        if self.control is not None:
            await self.control.close()
        self.control = None

    async def _read_metrics(self, lane: Lane) -> str | None:
        """The lane's metrics page, at most --max-metrics-bytes of it (the sampler bounds the
        time): a page past the limit is an error, not a truncated sample."""
        assert self.control is not None
        path = lane.url + self.config.backend_metrics_path
        query = metrics_query(self.config.queue_waiting_metric, self.config.queue_running_metric)
        limit = self.config.max_metrics_bytes
        async with self.control.get(URL(path + query, encoded=True)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {path} answered {resp.status}")
            if resp.content_length is not None and resp.content_length > limit:
                raise RuntimeError(
                    f"GET {path} declares {resp.content_length} bytes, over "
                    f"--max-metrics-bytes {limit}"
                )
            page = bytearray()
            async for chunk in resp.content.iter_any():
                page += chunk
                if len(page) > limit:
                    # aiohttp closes a connection left unread, so the rest is never read
                    raise RuntimeError(f"GET {path} sent more than --max-metrics-bytes {limit}")
            return page.decode("utf-8", errors="replace")

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
        """Whether each lane's health path answered 200 at its last probe (the probes that keep
        rotation, every --health-interval); before every lane's first probe has answered, it
        waits for them, at most --health-timeout. It sends nothing to a lane: GET /health needs
        no token, and probes of its own per request would let a flood of them crowd the probes
        that keep rotation out of the control pool (lanes then left rotation), and would make
        /health as slow as the slowest lane's answer."""
        if not self._probed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probed.wait(), self.config.health_timeout)
        return [lane.health_ok is True for lane in self.lanes]

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
            lane.health_ok = ok
            lane.health_failures = 0 if ok else lane.health_failures + 1
            if not self._probed.is_set() and all(x.health_ok is not None for x in self.lanes):
                self._probed.set()
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

    def client_write_paused(self, lane_paused: bool) -> None:
        self.stats.client_write_pauses += 1
        self.stats.lane_reads_paused += lane_paused

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
            body = json_error(401, "unauthorized", "missing or wrong bearer token")
            answer(conn, req, 401, body, [(b"www-authenticate", b'Bearer realm="slurmgate"')])
            return False
        if req.method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] in CONTROL_PATHS_B:
            if req.declared or any(key == b"transfer-encoding" for key, _ in req.headers):
                message = f"{req.method.decode()} {target.split(b'?', 1)[0].decode()} takes no body"
                body = json_error(400, "invalid_request_error", message)
                self.stats.statuses[answer(conn, req, 400, body)] += 1
                return False
            return True
        self.stats.requests += 1
        if not target.startswith(b"/"):
            # An authority-like target (``@host:port/x``) glued to a backend URL names another
            # host; only origin-form targets are proxied, as path and query.
            body = json_error(400, "invalid_request_error", BAD_TARGET.decode())
            self.stats.statuses[answer(conn, req, 400, body)] += 1
            return False
        # A length over --max-body-bytes was refused before it came here; the body joins the
        # budget as it arrives, never as declared.
        if req.declared is not None and req.declared < 0:
            body = json_error(400, "invalid_request_error", "bad Content-Length")
            self.stats.statuses[answer(conn, req, 400, body)] += 1
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
        message = f"request body over {self.max_body_bytes} bytes ({self.body_limit_flag})"
        self.stats.statuses[
            answer(conn, req, 413, json_error(413, "request_too_large", message))
        ] += 1

    def buffer_full(self, conn: ClientConnection, req: Incoming) -> None:
        self.stats.rejected_buffer_full += 1
        status = overloaded(
            conn,
            req,
            self.config,
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
            answer(conn, req, 408, json_error(408, "request_timeout", message))
        ] += 1

    def dispatch(self, conn: ClientConnection, req: Incoming) -> None:
        """The whole request is in: proxy it, or hand a control route to starlette."""
        path, _, query = req.target.partition(b"?")
        if req.method in (b"GET", b"HEAD") and path in CONTROL_PATHS_B:
            req.task = asyncio.create_task(self._control(conn, req, path.decode(), query))
        else:
            req.task = asyncio.create_task(self._handle(conn, req))

    async def _control(
        self, conn: ClientConnection, req: Incoming, path: str, query: bytes
    ) -> None:
        """/health and /metrics: starlette routes, called as ASGI with the whole request."""
        app = self._control_app
        assert app is not None, "endpoint not started"
        await answer_control(app, conn, req, path, query)

    # -- the hot path ----------------------------------------------------------------------

    async def _handle(self, conn: ClientConnection, req: Incoming) -> None:
        stats = self.stats
        try:
            if self.paired is not None:  # paired or refused, whatever its method
                status = await self.paired.forward(conn, req)
            else:
                status = await self.aggregated.forward(conn, req)
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


class EndpointServer:
    """The endpoint on its port: the data plane for every request, started and stopped here."""

    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self.endpoint = Endpoint(config)
        self.endpoint._control_app = control_routes(self.endpoint)
        self.connections = self.endpoint.connections
        self.max_connections = config.max_connections
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.plane: HAProxyPlane | None = None  # with --data-plane haproxy
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

        if cfg.data_plane == "haproxy":
            await self._start_behind_haproxy(factory, sock)
        else:
            if sock is not None:
                # Accepted sockets inherit it on Linux; asyncio sets it only when proto says TCP.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                server = await loop.create_server(factory, sock=sock, backlog=4096)
            else:
                server = await loop.create_server(
                    factory, self.config.host, self.config.port, backlog=4096, reuse_address=True
                )
            self._server = server
            self.port = server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._close_idle_connections())

    async def _start_behind_haproxy(
        self, factory: Callable[[], ClientConnection], sock: socket.socket | None
    ) -> None:
        """Listen on the plane's Unix socket, then start HAProxy on the endpoint's address."""
        cfg = self.config
        plane = self.plane = HAProxyPlane(cfg, self.endpoint.lanes, self.endpoint.policy)
        listener = sock
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                factory, str(plane.slow_socket), backlog=4096
            )
            if listener is None:
                listener = socket.create_server(
                    (cfg.host, cfg.port),
                    family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET,
                    backlog=4096,
                )
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.port = listener.getsockname()[1]
            await plane.start(listener, self.max_connections)
        except BaseException:
            await plane.stop(grace=0.0)
            if self._server is not None:
                self._server.close()
            raise
        finally:
            if listener is not None:
                listener.close()  # HAProxy holds its own copy; this process must not accept

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
        if self.plane is not None:
            await self.plane.stop(grace)
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


def freeze_startup_heap() -> None:
    """Take every object alive now out of the cyclic collector's scans, for good.

    Why: the imports (aiohttp, starlette, pydantic, prometheus_client) leave some 50,000
    tracked objects, and each full collection walked all of them on the one event loop: a
    40-50 ms stall every few seconds under load, which every request in flight then waited
    out (the endpoint's p99 at a fixed rate well below saturation was 37 ms against a p50 of
    2 ms). Requests themselves leave almost no cyclic garbage, so what the collector must
    still see is what is made after start-up; frozen objects are still freed by reference
    counting."""
    gc.collect()
    gc.freeze()


async def serve(
    config: EndpointConfig, sock: socket.socket | None = None, freeze_heap: bool = False
) -> None:
    """Serve the endpoint until SIGTERM/SIGINT (or cancellation); returns after a clean stop.
    ``freeze_heap``: the process is the endpoint's own, so its start-up heap is frozen once
    it listens (``freeze_startup_heap``)."""
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
    except DataPlaneError as exc:
        print(f"endpoint {config.name}: {exc}", file=sys.stderr, flush=True)
        await server.endpoint.stop()
        raise SystemExit(1) from exc
    if freeze_heap:
        freeze_startup_heap()
    waits = [asyncio.ensure_future(stopping.wait())]
    if server.plane is not None:
        waits.append(asyncio.ensure_future(server.plane.died.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
        await server.stop()
    if server.plane is not None and server.plane.died.is_set():
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
        f"endpoint {config.name}: listening on {config.host}:{config.port}"
        + (" through HAProxy" if config.data_plane == "haproxy" else "")
        + ", "
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
        runner.run(serve(config, freeze_heap=True))
