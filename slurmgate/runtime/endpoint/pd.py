"""SGLang's prefill/decode pairing as its router does it: the bootstrap fields of one request.

sglang-router in PD mode (`pd_router.rs` `execute_dual_dispatch`, sglang-router 0.3.2) sends the
identical JSON body to one prefill and one decode worker, with three fields injected: the
prefill's host (`bootstrap_host`), its bootstrap port (`bootstrap_port`, JSON null when none was
configured) and a random 63-bit `bootstrap_room` the two engines meet in. A batch (an array
prompt of texts, or batched `input_ids`, or chat with `n > 1`) carries one entry per item. The
endpoint does the same; the client's own bootstrap fields are always replaced, so a client can
never point a decode engine at a host of its choosing.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_BATCH = 4096  # items one request may ask rooms for
_rooms = random.SystemRandom()


def json_object(body: bytes | bytearray) -> dict[str, Any] | None:
    """The request body as a JSON object, or None when it is not one (then it is proxied to a
    decode lane as it came, and the engine answers it)."""
    stripped = bytes(body).strip()
    if not stripped.startswith(b"{"):
        return None
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


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


def paired_body(
    raw: bytes | bytearray,
    request: dict[str, Any],
    host: str,
    bootstrap_port: int | None,
    room: int | None = None,
) -> tuple[bytes, int]:
    """The body both lanes get, and its (first) room.

    The fields are appended to the client's JSON as it came (no re-serialisation, the common
    case); a body that already names one of them is rebuilt without the client's values.
    """
    items = batch_size(request)
    if items is not None and items > MAX_BATCH:
        raise ValueError(f"a batch of {items} items is over {MAX_BATCH}")
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
    body = bytes(raw).strip()
    if any(name in request for name in BOOTSTRAP_FIELDS):  # parsed keys: escapes decoded
        own = {k: v for k, v in request.items() if k not in BOOTSTRAP_FIELDS}
        body = json.dumps(own, separators=(",", ":")).encode()
    inner = body[1:-1].strip()
    if inner:
        return b"{" + inner + b"," + fields[1:], first
    return fields, first
