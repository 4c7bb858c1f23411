"""SGLang's prefill/decode pairing as its router does it: the bootstrap fields of one request.

sglang-router in PD mode (`pd_router.rs` `execute_dual_dispatch`, sglang-router 0.3.2) sends the
identical JSON body to one prefill and one decode worker, with three fields injected: the
prefill's host (`bootstrap_host`), its bootstrap port (`bootstrap_port`, JSON null when none was
configured) and a random 63-bit `bootstrap_room` the two engines meet in. A batch (an array
prompt of texts, or batched `input_ids`, or chat with `n > 1`) carries one entry per item. The
endpoint does the same; the client's own bootstrap fields are always replaced, so a client can
never point a decode engine at a host of its choosing.

The rule of a PD deployment: every request is paired or refused, none reaches a lane with
bootstrap fields the endpoint did not set.

- ``POST`` and ``PUT`` (SGLang serves ``PUT /generate`` too) with a body are paired: the body
  must be one JSON object (a UTF-8 byte order mark and whitespace around it are allowed, as the
  engine's parser allows them), else 400 naming why. Only plain UTF-8 JSON (no byte order
  mark) that starts with ``{`` is passed on as it came, with the fields appended; any other
  body the engine's parser reads (a byte order mark, UTF-16 or UTF-32 with or without one,
  whose first byte may be ``{`` too) is re-serialised, never appended to.
- A body without content (any method but those below) and ``GET``/``HEAD`` without a body go to
  a decode lane as they came: with no body there is no bootstrap field to carry.
- ``GET``/``HEAD`` with a body are refused (400); every other method with a body is 405.
- A body is bounded before it is parsed (``shape_error``): at most ``max_pd_body_bytes``
  (refused at its head, 413), and at most ``MAX_CONTAINERS`` brackets and ``MAX_VALUES`` commas,
  counted on the raw bytes (strings included, so an upper bound), since each costs the parse an
  object; nesting deeper than the interpreter's recursion limit fails the parse (400).
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_BATCH = 4096  # items one request may ask rooms for
MAX_CONTAINERS = 262_144  # `{` and `[` bytes in one PD body (each is a dict or list parsed)
MAX_VALUES = 2_000_000  # `,` bytes in one PD body (about one parsed value each)
PAIRED_METHODS = frozenset({b"POST", b"PUT"})
BODYLESS_METHODS = frozenset({b"GET", b"HEAD"})
_rooms = random.SystemRandom()


@dataclass(frozen=True, slots=True)
class Pairable:
    """A PD body ready for its lanes: the client's JSON object (without bootstrap fields, as
    bytes starting with ``{``) and its batch size; the fields are appended per pairing."""

    body: bytes
    items: int | None


def shape_error(body: bytes | bytearray) -> str | None:
    """Why a body's parse would build too many objects (None when it would not), told before
    it is parsed."""
    containers = body.count(b"{") + body.count(b"[")
    if containers > MAX_CONTAINERS:
        return f"the body has {containers} brackets, over {MAX_CONTAINERS}"
    values = body.count(b",")
    if values > MAX_VALUES:
        return f"the body has {values} commas, over {MAX_VALUES}"
    return None


def pairable(raw: bytes) -> Pairable | str:
    """The body as a JSON object ready to pair, or why it cannot be paired. Meant for a worker
    thread: it parses the whole body. It raises nothing, so no traceback keeps the parse alive."""
    error = shape_error(raw)
    if error is not None:
        return error
    try:
        value = json.loads(raw)  # bytes: a BOM or UTF-16/32 decoded as the engine does
    except (ValueError, RecursionError) as exc:
        return f"the body is not JSON: {str(exc)[:120]}"
    if not isinstance(value, dict):
        return f"the body is a JSON {type(value).__name__}, not an object"
    items = batch_size(value)
    if items is not None and items > MAX_BATCH:
        return f"a batch of {items} items is over {MAX_BATCH}"
    body = raw.strip(b" \t\r\n")
    plain = json.detect_encoding(raw) == "utf-8" and body.startswith(b"{")  # as json.loads saw
    if not plain or any(name in value for name in BOOTSTRAP_FIELDS):
        # parsed keys: escapes decoded; a body that is not plain UTF-8 JSON is rebuilt too
        own = {k: v for k, v in value.items() if k not in BOOTSTRAP_FIELDS}
        body = json.dumps(own, separators=(",", ":")).encode()
    return Pairable(body, items)


def batch_size(request: dict[str, Any]) -> int | None:
    """Items of a batched request (one room each), or None for a single request."""
    prompt = request.get("prompt", request.get("text"))
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    ids = request.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    n = request.get("n")
    if "messages" in request and isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    return None


@functools.lru_cache(maxsize=256)
def _single_fields(host: str, bootstrap_port: int | None) -> bytes:
    """A single request's fields up to the room's value: the same for every request of a lane."""
    return b'{"bootstrap_host":%s,"bootstrap_port":%s,"bootstrap_room":' % (
        json.dumps(host).encode(),
        json.dumps(bootstrap_port).encode(),
    )


def paired(
    ready: Pairable, host: str, bootstrap_port: int | None, room: int | None = None
) -> tuple[bytes, int]:
    """The body both lanes get, and its (first) room: the fields appended to the client's
    JSON object (no re-serialisation in the common case)."""
    items = ready.items
    first = _rooms.getrandbits(63) if room is None else room
    if items is None:
        fields = _single_fields(host, bootstrap_port) + b"%d}" % first
    else:
        rooms = [first] + [_rooms.getrandbits(63) for _ in range(items - 1)]
        fields = json.dumps(
            {
                "bootstrap_host": [host] * items,
                "bootstrap_port": [bootstrap_port] * items,
                "bootstrap_room": rooms,
            },
            separators=(",", ":"),
        ).encode()
    inner = ready.body[1:-1].strip()
    if inner:
        return b"{" + inner + b"," + fields[1:], first
    return fields, first


def paired_body(
    raw: bytes | bytearray,
    request: dict[str, Any],
    host: str,
    bootstrap_port: int | None,
    room: int | None = None,
) -> tuple[bytes, int]:
    """The body both lanes get, and its (first) room (``pairable`` then ``paired``; the parsed
    ``request`` is parsed again, kept for callers that hold one)."""
    del request
    ready = pairable(bytes(raw))
    if isinstance(ready, str):
        raise ValueError(ready)
    return paired(ready, host, bootstrap_port, room)
