"""The stub engine's prefill/decode pairing: a prefill's bootstrap server and a decode's wait on it.

SGLang pairs the two halves of a disaggregated request by a `bootstrap_room` that the router
(sglang-router, or slurmgate's PD endpoint) injects into the identical body it sends to both,
with the prefill's `bootstrap_host` and `bootstrap_port`. The decode engine reaches the prefill's
bootstrap server there and waits until that room's KV cache has arrived before it emits tokens.

The stub does the same on loopback or across nodes without a GPU: a prefill lane listens on its
`--disaggregation-bootstrap-port` (a line protocol, `rooms R1 R2 …` answered `ok` once every room
was prefilled, or `timeout`); a decode lane asks there before its first token, so a decode
answer exists only when its prefill ran. Tables and waits are bounded (hostile clients can send
any room number).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import OrderedDict
from typing import Any

MAX_ROOMS = 65536  # prefilled rooms remembered (oldest forgotten first)
MAX_BATCH = 256  # rooms one request may carry (a batched prompt)
LINE_LIMIT = 8192
ROOM_MAX = 2**64


class PairingError(Exception):
    """A decode request that cannot be paired with its prefill: the HTTP status and why."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _rooms_of(value: Any) -> list[int]:
    items = value if isinstance(value, list) else [value]
    if not 1 <= len(items) <= MAX_BATCH:
        raise PairingError(f"bootstrap_room must carry 1 to {MAX_BATCH} rooms", 400)
    rooms: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < ROOM_MAX:
            raise PairingError("bootstrap_room must be a non-negative 64-bit integer", 400)
        rooms.append(item)
    return rooms


def request_rooms(request: dict[str, Any], *, required: bool) -> list[int]:
    """The bootstrap rooms a request names (one per batch item); [] when it names none."""
    if request.get("bootstrap_room") is None:
        if required:
            raise PairingError(
                "a decode lane needs bootstrap_host, bootstrap_port and bootstrap_room: send "
                "the request through a PD router (sglang-router --pd-disaggregation or "
                "slurmgate's PD endpoint)",
                400,
            )
        return []
    return _rooms_of(request["bootstrap_room"])


def bootstrap_address(request: dict[str, Any]) -> tuple[str, int]:
    """(host, port) of the prefill's bootstrap server named in a decode request."""
    host = request.get("bootstrap_host")
    port = request.get("bootstrap_port")
    if isinstance(host, list):
        host = host[0] if host else None
    if isinstance(port, list):
        port = port[0] if port else None
    if not isinstance(host, str) or not host or len(host) > 255:
        raise PairingError("bootstrap_host must name the prefill's host", 400)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise PairingError(
            "bootstrap_port must be the prefill's bootstrap port (the router's --prefill URL "
            "PORT, or the endpoint's backend bootstrap port)",
            400,
        )
    return host.strip("[]"), port


class PrefilledRooms:
    """A prefill lane's rooms: set once prefilled, awaited by decode lanes (bounded)."""

    def __init__(self, log: bool) -> None:
        self._events: OrderedDict[int, asyncio.Event] = OrderedDict()
        self.log = log
        self.prefilled = 0

    def _event(self, room: int) -> asyncio.Event:
        event = self._events.get(room)
        if event is None:
            event = self._events[room] = asyncio.Event()
            while len(self._events) > MAX_ROOMS:
                self._events.popitem(last=False)
        return event

    def done(self, rooms: list[int]) -> None:
        for room in rooms:
            self._event(room).set()
            self.prefilled += 1
            if self.log:
                print(f"stub_server: prefill bootstrap_room {room}", file=sys.stderr, flush=True)

    async def wait(self, rooms: list[int], timeout: float) -> bool:
        events = [self._event(room) for room in rooms]
        try:
            async with asyncio.timeout(timeout):
                for event in events:
                    await event.wait()
        except TimeoutError:
            return False
        return True


async def serve_bootstrap(
    rooms: PrefilledRooms, host: str, port: int, timeout: float
) -> asyncio.Server:
    """The prefill's bootstrap server: answer each `rooms …` line once they were prefilled."""

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5.0):
                line = await reader.readline()
            words = line.decode(errors="replace").split()
            if not words or words[0] != "rooms" or not 2 <= len(words) <= MAX_BATCH + 1:
                writer.write(b"bad\n")
                return
            try:
                wanted = _rooms_of([int(w) for w in words[1:]])
            except (ValueError, PairingError):
                writer.write(b"bad\n")
                return
            ok = await rooms.wait(wanted, timeout)
            writer.write(b"ok\n" if ok else b"timeout\n")
            await writer.drain()
        except (OSError, TimeoutError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    return await asyncio.start_server(peer, host=host, port=port, limit=LINE_LIMIT)


async def await_prefill(
    request: dict[str, Any], rooms: list[int], timeout: float, log: bool
) -> float:
    """Block a decode request until its prefill's bootstrap server confirms every room.

    Returns the seconds waited; raises PairingError (502 when the prefill is unreachable,
    504 when it never prefilled the room in time).
    """
    host, port = bootstrap_address(request)
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout + 1.0):
            reader, writer = await asyncio.open_connection(host, port, limit=LINE_LIMIT)
            try:
                writer.write(("rooms " + " ".join(map(str, rooms)) + "\n").encode())
                await writer.drain()
                answer = (await reader.readline()).strip()
            finally:
                writer.close()
    except TimeoutError:
        answer = b"timeout"
    except OSError as exc:
        raise PairingError(
            f"the prefill's bootstrap server {host}:{port} is unreachable ({exc.strerror or exc})",
            502,
        ) from None
    if answer != b"ok":
        raise PairingError(
            f"prefill never delivered bootstrap_room {rooms[0]} within {timeout:g}s "
            f"(bootstrap server {host}:{port} said {answer.decode(errors='replace')!r})",
            504,
        )
    if log:
        for room in rooms:
            print(f"stub_server: decode bootstrap_room {room}", file=sys.stderr, flush=True)
    return time.monotonic() - started
