"""The control routes, /health and /metrics: starlette, called as ASGI with the whole request."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming
from slurmgate.runtime.endpoint.metrics import Observed, StatsCollector

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CONTROL_PATHS_B = frozenset({b"/health", b"/metrics"})


class Controlled(Observed, Protocol):
    """What the control routes ask of the endpoint: its state, and its lanes' health as its
    probes last found it."""

    async def backend_health(self) -> list[bool]: ...


def control_routes(endpoint: Controlled) -> ASGIApp:
    """``/health`` and ``/metrics`` as starlette routes."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(endpoint))

    async def health(request: Request) -> Response:
        ready = await endpoint.backend_health()
        payload = {"backends_ready": sum(ready), "backends": len(ready)}
        return JSONResponse(payload, status_code=200 if all(ready) else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[Route("/health", health), Route("/metrics", metrics)])


async def answer_control(
    app: ASGIApp, conn: ClientConnection, req: Incoming, path: str, query: bytes
) -> None:
    """Call a control route as ASGI with the whole request, and send its answer whole."""
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
    headers = [(k.lower(), v) for k, v in head.get("headers", []) if k.lower() != b"content-length"]
    conn.send_full(req, head.get("status", 500), headers, b"".join(chunks))


def asgi_scope(req: Incoming, path: str, query: bytes) -> dict[str, Any]:
    """An ASGI HTTP scope for a request the control routes (starlette) answer."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1" if req.http11 else "1.0",
        "method": req.method.decode("latin-1"),
        "scheme": "http",
        "path": path,
        "raw_path": req.target.split(b"?", 1)[0],
        "query_string": query,
        "root_path": "",
        "headers": req.headers,
        "server": None,
        "client": None,
    }
