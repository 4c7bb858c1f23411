"""The prefill/decode path: one request sent to a paired prefill and decode lane, decode answering.

Only a connection that could not be made moves a leg on to another lane of its role (nothing
was sent yet); every other failure happens after the pairing was fixed, and is answered (502).
The body is read as JSON once, when the request arrives (``pd.json_object``: anything else goes
the aggregated way, to a decode lane), and rewritten with the bootstrap fields once both lanes
are known (``pd.paired_body``); both legs get the same bytes.
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
    Failure,
    Interrupted,
    LaneLinks,
    NotConnected,
    Sent,
    Stale,
    TimedOut,
    pass_on,
    read_if_small,
    read_whole,
)
from slurmgate.runtime.endpoint.heads import request_head, response_headers
from slurmgate.runtime.endpoint.metrics import EndpointStats
from slurmgate.runtime.endpoint.routing import LeastActiveRouter

Prefilled = Buffered | Failure | BrokeOff  # what the prefill leg ends in


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
        self.unpaired = unpaired  # what is not a JSON object goes to a decode lane as it came
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
        request = pd.json_object(req.body)
        if request is None:
            return await self.unpaired.forward(conn, req)  # not a generation request
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
            try:
                body, _ = pd.paired_body(
                    req.body, request, self.bootstrap_hosts[index], prefill.lane.bootstrap_port
                )
            except ValueError as exc:
                message = f"cannot pair the request: {exc}"
                return answer(conn, req, 400, json_error(400, "invalid_request_error", message))
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
                    p_verdict = False
                    return _leg_failed(conn, req, "prefill", prefilled)
                p_verdict = prefilled.status < 500
                if not 200 <= prefilled.status < 300:
                    # the prefill refused it: its answer is the request's
                    out = response_headers(prefilled.headers)
                    conn.send_full(req, prefilled.status, out, prefilled.body)
                    return prefilled.status
            if not isinstance(sent, Answered):
                d_verdict = False
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

    async def _send_leg(self, leg: Leg, head: bytes, body: bytes) -> Sent | NotConnected:
        """Send the paired body on a leg's connection; a reused connection the lane had closed
        (before any byte of the answer) is replaced once by a new one to the same lane, so the
        pairing holds. A leg interrupted by its partner's failure ends ``Interrupted``."""
        attempt = leg.attempt
        sent = await attempt.send(head, body)
        # A first-byte timeout on a reused connection that never answered counts as stale too.
        stale = isinstance(sent, Stale | TimedOut) and attempt.reused_unanswered
        if not stale or leg.retried or leg.interrupted:
            return sent
        leg.retried = True
        self.stats.retries["stale"] += 1
        not_connected = await attempt.reconnect()
        if not_connected is not None:
            return not_connected
        if leg.interrupted:  # the partner failed while this leg reconnected
            return Interrupted()
        return await attempt.send(head, body)

    async def _prefill(self, leg: Leg, head: bytes, body: bytes) -> Prefilled:
        sent = await self._send_leg(leg, head, body)
        if not isinstance(sent, Answered):
            return sent
        upstream = sent.upstream
        status, headers = upstream.status, upstream.headers
        data = await read_whole(upstream)
        if isinstance(data, BrokeOff):
            return data
        return Buffered(status, headers, data)


def _leg_failed(
    conn: ClientConnection, req: Incoming, role: str, failure: Failure | BrokeOff
) -> int:
    reason = "timeout" if failure.timed_out else "dropped"
    message = f"the {role} backend failed before answering ({reason}); not retried"
    return bad_gateway(conn, req, message)
