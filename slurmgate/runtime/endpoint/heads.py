"""Heads as forwarded: a request's head to its lane, an answer's headers back to the client."""

from __future__ import annotations

from collections.abc import Iterable

from slurmgate.runtime.endpoint.dataplane import Incoming

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


def strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """Drop hop-by-hop headers and every header the Connection header nominates."""
    # One pass, since it runs twice per request: a Connection header is rare, and only then
    # is what was kept filtered again.
    kept: list[tuple[bytes, bytes]] = []
    nominated: set[bytes] | None = None
    for key, value in headers:
        key = key.lower()
        if key == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")} - {b""}
            nominated = tokens if nominated is None else nominated | tokens
        if key not in drop:
            kept.append((key, value))
    if not nominated:
        return kept
    return [(k, v) for k, v in kept if k not in nominated]


def request_head(
    req: Incoming, not_forwarded: frozenset[bytes], size: int | None = None
) -> tuple[bytes, bytes]:
    """The upstream request's head, around the lane's host: (before, after); ``size`` is
    the body's length when the endpoint rewrote it."""
    headers = strip_hop_by_hop(req.headers, not_forwarded)
    lines = b"".join([b"%s: %s\r\n" % pair for pair in headers])
    if size is not None:
        lines += b"content-length: %d\r\n" % size
    elif req.size or req.method not in NO_BODY_METHODS:
        lines += b"content-length: %d\r\n" % req.size
    return req.method + b" " + req.target + b" HTTP/1.1\r\nhost: ", b"\r\n" + lines + b"\r\n"


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An upstream answer's headers as forwarded: no hop-by-hop ones, no framing (the data
    plane frames the answer itself)."""
    return strip_hop_by_hop(headers, NOT_FORWARDED_DOWN)


def retry_after_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    for key, value in headers:
        if key.lower() == b"retry-after":
            return value
    return None
