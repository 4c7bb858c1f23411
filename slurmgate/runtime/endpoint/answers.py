"""The endpoint's own answers to a client: JSON error bodies, and 429s with their Retry-After."""

from __future__ import annotations

import json
from typing import Any

from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming


def json_error(status: int, kind: str, message: str, **extra: Any) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "code": status, **extra}}
    ).encode()


def answer(
    conn: ClientConnection,
    req: Incoming,
    status: int,
    body: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> int:
    """A whole JSON answer of the endpoint's own; returns its status."""
    headers = [(b"content-type", b"application/json")]
    if extra:
        headers.extend(extra)
    conn.send_full(req, status, headers, body)
    return status


def bad_gateway(conn: ClientConnection, req: Incoming, message: str) -> int:
    return answer(conn, req, 502, json_error(502, "bad_gateway", message))


def overloaded(
    conn: ClientConnection,
    req: Incoming,
    config: EndpointConfig,
    retry_after: bytes | None,
    message: str,
) -> int:
    """A 429 that names the queue limit and the endpoint, with ``retry_after`` when set."""
    extra = [(b"retry-after", retry_after)] if retry_after else None
    body = json_error(
        429,
        "rate_limit_exceeded",
        message,
        max_waiting_requests=config.max_waiting,
        endpoint=config.name,
    )
    return answer(conn, req, 429, body, extra)
