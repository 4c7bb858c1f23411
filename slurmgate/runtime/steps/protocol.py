"""The messages a node worker writes for the controller: one typed line per event, one parser.

Each message is one line, `SLURMGATE-MSG ` and a compact JSON object with its `kind`, written
in a single write so that srun, which interleaves the tasks' output, never splits it. The node
worker writes these beside its human lines (`[node-worker H] ...`, `SLURMGATE-PREFLIGHT ...`),
which stay for people reading the logs; the controller reads only the messages.

The parser takes a step's log as it is: lines srun ran together, a tail cut mid-line, lines
of the engines' own output. It never raises: a line too long, a malformed object, a missing
or mistyped field or an unknown kind is skipped. This module is standard-library only: the
node worker imports it on every node.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

PREFIX = "SLURMGATE-MSG "
MAX_LINE_CHARS = 8192  # a line longer than this is skipped unread
DETAIL_CHARS = 1000  # a message's free text is cut to this when written


@dataclass(frozen=True)
class PreflightPassed:
    """Every check passed on `host`, which holds `cpus` CPUs and sees `gpus` GPUs."""

    kind: ClassVar[str] = "preflight-ok"
    host: str
    cpus: int
    gpus: int


@dataclass(frozen=True)
class PreflightCheckFailed:
    """The check `check` failed on `host`; `detail` says how."""

    kind: ClassVar[str] = "preflight-failed"
    host: str
    check: str
    detail: str


@dataclass(frozen=True)
class LaneStarted:
    """The lane `lane` started on `host`."""

    kind: ClassVar[str] = "lane-started"
    host: str
    lane: str


@dataclass(frozen=True)
class LaneSpawnFailed:
    """The lane `lane` could not be started on `host` (its program); `detail` says why."""

    kind: ClassVar[str] = "lane-spawn-failed"
    host: str
    lane: str
    detail: str


@dataclass(frozen=True)
class LaneExited:
    """The lane `lane` on `host` exited with `status` after `uptime_s` seconds (tenths)."""

    kind: ClassVar[str] = "lane-exited"
    host: str
    lane: str
    status: int
    uptime_s: float


Message = PreflightPassed | PreflightCheckFailed | LaneStarted | LaneSpawnFailed | LaneExited
M = TypeVar("M", bound=Message)

# Each kind's class, and its fields with their JSON types in the order the line carries them.
_KINDS: dict[str, tuple[type[Message], dict[str, type]]] = {
    PreflightPassed.kind: (PreflightPassed, {"host": str, "cpus": int, "gpus": int}),
    PreflightCheckFailed.kind: (
        PreflightCheckFailed,
        {"host": str, "check": str, "detail": str},
    ),
    LaneStarted.kind: (LaneStarted, {"host": str, "lane": str}),
    LaneSpawnFailed.kind: (LaneSpawnFailed, {"host": str, "lane": str, "detail": str}),
    LaneExited.kind: (
        LaneExited,
        {"host": str, "lane": str, "status": int, "uptime_s": float},
    ),
}


def encode(message: Message) -> str:
    """The message's line, without its newline: the prefix and one compact JSON object.

    Free text is cut to DETAIL_CHARS, and an uptime is carried in tenths of a second, as the
    human line shows it, so what the controller judges is what a person reads.
    """
    _, fields = _KINDS[message.kind]
    body: dict[str, Any] = {"kind": message.kind}
    for name in fields:
        value = getattr(message, name)
        if name == "detail":
            value = str(value)[:DETAIL_CHARS]
        elif name == "uptime_s":
            value = round(float(value), 1)
        body[name] = value
    return PREFIX + json.dumps(body, separators=(",", ":"))


def _decode(body: Any) -> Message | None:
    """The message a decoded JSON value is, or None: a known kind with every field typed."""
    if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
        return None
    known = _KINDS.get(body["kind"])
    if known is None:
        return None
    cls, fields = known
    values: dict[str, Any] = {}
    for name, kind in fields.items():
        value = body.get(name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return None
        values[name] = value
    return cls(**values)


def parse(log: str) -> Iterator[Message]:
    """Every message in a step's log, in order; anything else is skipped, never raised on."""
    decoder = json.JSONDecoder()
    for line in log.splitlines():
        if len(line) > MAX_LINE_CHARS:
            continue
        start = line.find(PREFIX)
        # srun may run two tasks' lines together: every prefix on the line starts a message.
        while start != -1:
            at = start + len(PREFIX)
            try:
                body, _ = decoder.raw_decode(line, at)
            except (ValueError, RecursionError):  # not JSON, or nested past the stack
                body = None
            message = _decode(body)
            if message is not None:
                yield message
            start = line.find(PREFIX, at)


def messages(log: str, kind: type[M]) -> list[M]:
    """The messages of one kind in a step's log, in order."""
    return [m for m in parse(log) if isinstance(m, kind)]


def lane_exit_cause(log: str) -> str:
    """`: lane L on node H exited with status N` for the first lane exit in a step's log."""
    exits = messages(log, LaneExited)
    if not exits:
        return ""
    first = exits[0]
    return f": lane {first.lane} on node {first.host} exited with status {first.status}"
