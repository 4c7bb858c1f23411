"""The prefill/decode path: one request sent to a paired prefill and decode lane, decode answering.

Only a connection that could not be made moves a leg on to another lane of its role (nothing
was sent yet); every other failure happens after the pairing was fixed, and is answered once:
a first-byte timeout 504, a lane that left rotation 503 (cut short as soon as it left), any
other failure 502. Every request is paired or refused by the rule in ``pd.py``: a body is
parsed once (``pd.pairable``), before any lane is taken, and gets its bootstrap fields once both
lanes are known (``pd.paired``); both legs get the same bytes. A body of up to 16 KiB is parsed
on the event loop (under 1 ms); a larger one in the endpoint's parser process
(``pdparser.py``), one at a time and within ``--pd-parse-timeout``, so the event loop keeps
answering while it parses and the parses' memory stays one body's, outside the endpoint.
The prefill leg gives its slot, its count and its connection back as soon as its answer is
read whole: the decode's stream does not hold a prefill lane.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from slurmgate.runtime.endpoint import pd
from slurmgate.runtime.endpoint.aggregated import AggregatedPath
from slurmgate.runtime.endpoint.answers import answer, bad_gateway, json_error, overloaded
from slurmgate.runtime.endpoint.backpressure import Lane
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.dataplane import ClientConnection, Incoming
from slurmgate.runtime.endpoint.forward import (
    Answered,
    Attempt,
    BrokenStream,
    BrokeOff,
    Buffered,
    CutOff,
    Failure,
    Interrupted,
    LaneLinks,
    NotConnected,
    Sent,
    Stale,
    pass_on,
    read_if_small,
    read_whole,
)
from slurmgate.runtime.endpoint.heads import request_head, response_headers
from slurmgate.runtime.endpoint.metrics import EndpointStats
from slurmgate.runtime.endpoint.pdparser import INLINE_BYTES, ChildParser, Parsed, ParseFailed
from slurmgate.runtime.endpoint.routing import LeastActiveRouter

Prefilled = Buffered | Failure | BrokeOff  # what the prefill leg ends in
ALLOWED = b"GET, HEAD, POST, PUT"  # the methods a PD deployment serves (``pd.py``'s rule)


@dataclass
class Leg:
    """One side of a disaggregated request: its attempt on one lane of its role."""

    attempt: Attempt
    retried: bool = False  # its stale-connection retry is spent
    interrupted: bool = False  # the other leg failed: this one is given up

    @property
    def lane(self) -> Lane:
        return self.attempt.lane

    def interrupt(self) -> None:
        self.interrupted = True
        self.attempt.interrupt()


def _interrupt_on_failure(decode: Leg, prefilling: asyncio.Task[Prefilled]) -> None:
    """The prefill task's done-callback: a failed prefill cuts its decode's wait short."""
    if prefilling.cancelled():
        return
    error = prefilling.exception()
    if error is None:
        prefilled = prefilling.result()
        if isinstance(prefilled, Buffered) and 200 <= prefilled.status < 300:
            return
    decode.interrupt()


class PairedPath:
    """Pair a prefill and a decode lane per request, as sglang-router does in PD mode."""

    def __init__(
        self,
        config: EndpointConfig,
        stats: EndpointStats,
        prefill_router: LeastActiveRouter,
        decode_router: LeastActiveRouter,
        links: LaneLinks,
        not_forwarded: frozenset[bytes],
        unpaired: AggregatedPath,
    ) -> None:
        self.config = config
        self.stats = stats
        self.prefill_router = prefill_router
        self.decode_router = decode_router
        self.links = links
        self.not_forwarded = not_forwarded
        self.unpaired = unpaired  # what has no body goes to a decode lane as it came
        # A large body is parsed in a child process, one at a time (``pdparser.py``).
        self.parsing = asyncio.Semaphore(1)
        self.parser = ChildParser(config.pd_parse_timeout)
        # a prefill lane's bootstrap_host: its URL's host, as sglang-router injects it
        lanes = prefill_router.lanes
        self.bootstrap_hosts = {lane.index: urlsplit(lane.url).hostname or "" for lane in lanes}

    async def forward(self, conn: ClientConnection, req: Incoming) -> int:
        """Pair a prefill and a decode lane, send both the request with SGLang's bootstrap
        fields, and answer with the decode's answer (streamed as it comes).

        The prefill runs in a task of its own; the decode is awaited here. A prefill that fails
        (an error, or an answer that is not 2xx) interrupts the decode's wait from the task's
        done-callback, so the request never waits on a decode that waits in vain for its
        bootstrap room; the prefill's answer (or a 502) is then the request's.
        """
        ready = await self._pairable(conn, req)
        if isinstance(ready, int):
            return ready
        if ready is None:
            return await self.unpaired.forward(conn, req)  # no body: nothing to pair
        prefill = await self._open_leg(conn, req, self.prefill_router, "prefill")
        if isinstance(prefill, int):
            return prefill
        p_verdict: bool | None = None
        d_verdict: bool | None = None
        decode: Leg | int | None = None
        prefilling: asyncio.Task[Prefilled] | None = None
        try:
            decode = await self._open_leg(conn, req, self.decode_router, "decode")
            if isinstance(decode, int):
                return decode
            index = prefill.lane.index
            body, _ = pd.paired(ready, self.bootstrap_hosts[index], prefill.lane.bootstrap_port)
            del ready
            before, after = request_head(req, self.not_forwarded, len(body))
            hosts = self.links.hosts
            prefilling = asyncio.create_task(
                self._prefill(prefill, before + hosts[index] + after, body)
            )
            prefilling.add_done_callback(functools.partial(_interrupt_on_failure, decode))
            sent = await self._send_leg(decode, before + hosts[decode.lane.index] + after, body)
            if isinstance(sent, Answered) or decode.interrupted:
                # the decode's head is in (or the prefill cut it off): the prefill decides
                prefilled = await prefilling
                if not isinstance(prefilled, Buffered):
                    p_verdict = None if isinstance(prefilled, CutOff) else False
                    return _leg_failed(conn, req, "prefill", prefilled)
                p_verdict = prefilled.status < 500
                if not 200 <= prefilled.status < 300:
                    # the prefill refused it: its answer is the request's
                    out = response_headers(prefilled.headers)
                    conn.send_full(req, prefilled.status, out, prefilled.body)
                    return prefilled.status
            if not isinstance(sent, Answered):
                d_verdict = None if isinstance(sent, CutOff) else False
                return _leg_failed(conn, req, "decode", sent)
            upstream = sent.upstream
            d_verdict = upstream.status < 500
            whole = await read_if_small(upstream, req)
            if isinstance(whole, BrokeOff):
                d_verdict = False
                message = "the decode backend broke off its answer; not retried"
                return bad_gateway(conn, req, message)
            try:
                idle = decode.attempt.timeouts.stream_idle
                return await pass_on(conn, req, upstream, whole, idle)
            except BrokenStream:
                d_verdict = False
                raise
        finally:
            if prefilling is not None:
                if not prefilling.done():
                    prefilling.cancel()
                    await asyncio.wait([prefilling])  # its connection is quiet before release
                if not prefilling.cancelled():
                    prefilling.exception()  # retrieved: a failure was answered above
            prefill.attempt.close(p_verdict)
            if isinstance(decode, Leg):
                decode.attempt.close(d_verdict)

    async def _pairable(self, conn: ClientConnection, req: Incoming) -> pd.Pairable | int | None:
        """The request's body ready to pair; None when it has none (it goes to a decode lane
        as it came); else the status of the refusal answered (``pd.py``'s rule)."""
        method = req.method
        if not req.body:
            return None
        if method in pd.BODYLESS_METHODS:
            message = f"a {method.decode()} request to a prefill/decode deployment has no body"
            return answer(conn, req, 400, json_error(400, "invalid_request_error", message))
        if method not in pd.PAIRED_METHODS:
            message = (
                f"{method.decode(errors='replace')} is not paired by a prefill/decode "
                "deployment; use POST"
            )
            body = json_error(405, "method_not_allowed", message)
            return answer(conn, req, 405, body, [(b"allow", ALLOWED)])
        ready: Parsed
        if len(req.body) <= INLINE_BYTES:
            ready = pd.pairable(bytes(req.body))  # cheaper than handing it to the parser
        else:
            await self.parsing.acquire()
            parsing = self.parser.parse(bytes(req.body))
            parsing.add_done_callback(self._parsed)
            ready = await asyncio.shield(parsing)  # a client that leaves does not stop a parse
        if isinstance(ready, ParseFailed):
            self.stats.pd_parse_failures += 1
            kind = "request_too_large" if ready.status == 413 else "service_unavailable"
            message = f"cannot pair the request: {ready.reason}"
            return answer(conn, req, ready.status, json_error(ready.status, kind, message))
        if isinstance(ready, str):
            message = f"cannot pair the request: {ready}"
            return answer(conn, req, 400, json_error(400, "invalid_request_error", message))
        return ready

    def start(self) -> None:
        """Start the parser process, so the first large body need not wait for it."""
        self.parser.start()

    def close(self) -> None:
        """Stop the parser process and its thread (a parse under way fails at once)."""
        self.parser.close()

    def _parsed(self, parsing: asyncio.Future[Parsed]) -> None:
        """A parse ended (its request may be gone): the next one may start."""
        self.parsing.release()
        if not parsing.cancelled():
            parsing.exception()  # retrieved: a parse that failed unforeseen leaves no warning

    async def _open_leg(
        self, conn: ClientConnection, req: Incoming, router: LeastActiveRouter, role: str
    ) -> Leg | int:
        """A connection to the least active admitted lane of one role, or the status answered."""
        stats = self.stats
        tried: list[Lane] = []
        failures: list[str] = []
        for _ in range(min(self.config.max_attempts, len(router.lanes))):
            lane = router.pick(time.monotonic(), tried)
            if lane is None:
                break
            tried.append(lane)
            stats.attempts += 1
            attempt = self.links.attempt(lane)
            await attempt.take()
            try:
                not_connected = await attempt.connect()
            except BaseException:
                attempt.close(None)
                raise
            if not_connected is not None:
                failures.append(not_connected.reason)
                attempt.close(False)
                continue
            for reason in failures:
                stats.retries[reason] += 1
            return Leg(attempt)
        for reason in failures[:-1]:
            stats.retries[reason] += 1
        if not tried:
            stats.rejected_overload += 1
            message = f"every {role} backend is over its queue limit"
            return overloaded(conn, req, self.config, self.config.retry_after_header, message)
        return bad_gateway(conn, req, f"no {role} backend could be reached")

    async def _send_leg(self, leg: Leg, head: bytes, body: bytes) -> Sent | NotConnected | CutOff:
        """Send the paired body on a leg's connection; a reused connection the lane had closed
        (before any byte of the answer) is replaced once by a new one to the same lane, so the
        pairing holds. A first-byte timeout is not a stale connection: it ends the leg. A leg
        interrupted by its partner's failure ends ``Interrupted``; one whose lane left rotation
        while it waited ends ``CutOff``."""
        attempt = leg.attempt
        sent = await attempt.watched(attempt.send(head, body))
        stale = isinstance(sent, Stale) and attempt.reused_unanswered
        if not stale or leg.retried or leg.interrupted:
            return sent
        leg.retried = True
        self.stats.retries["stale"] += 1
        not_connected = await attempt.reconnect()
        if not_connected is not None:
            return not_connected
        if leg.interrupted:  # the partner failed while this leg reconnected
            return Interrupted()
        return await attempt.watched(attempt.send(head, body))

    async def _prefill(self, leg: Leg, head: bytes, body: bytes) -> Prefilled:
        sent = await self._send_leg(leg, head, body)
        if not isinstance(sent, Answered):
            return sent
        upstream = sent.upstream
        status, headers = upstream.status, upstream.headers
        data = await read_whole(upstream)
        if isinstance(data, BrokeOff):
            return data
        # read whole: the prefill lane's slot, count and connection are given back now
        leg.attempt.close(status < 500)
        return Buffered(status, headers, data)


def _leg_failed(
    conn: ClientConnection, req: Incoming, role: str, failure: Failure | BrokeOff
) -> int:
    """A leg's failure, answered once: 504 for a timeout, 503 for a lane that left rotation,
    else 502; never retried, since the pairing was fixed."""
    if failure.timed_out:
        message = f"the {role} backend did not answer in time; not retried"
        return answer(conn, req, 504, json_error(504, "gateway_timeout", message))
    if isinstance(failure, CutOff):
        message = f"the {role} backend left rotation before answering; not retried"
        return answer(conn, req, 503, json_error(503, "service_unavailable", message))
    message = f"the {role} backend failed before answering (dropped); not retried"
    return bad_gateway(conn, req, message)
