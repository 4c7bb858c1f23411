"""The streaming chat load: closed loop at a concurrency or open loop at a rate, and its report.

``run_chat_load`` streams ``/v1/chat/completions`` over SSE with prompt and output lengths
drawn from a seeded distribution. It reports time to first token, inter-token latency and
end-to-end latency (p50/p90/p99), output tokens/s, requests/s, 429s and errors, and keeps the
per-request timings a server sends (llama.cpp's ``timings``) next to its own.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp

from slurmgate.runtime.loadgen.report import ChatReport, histogram, latency_stats
from slurmgate.runtime.loadgen.stream import ChatResult, stream_chat
from slurmgate.runtime.loadgen.workload import ChatLoadSpec, arrival_gaps, retry_after_seconds

MAX_TIMED_REQUESTS = 1000


def _timed_row(result: ChatResult) -> dict[str, float]:
    itl = result.itl
    row = {
        "ttft": result.ttft or 0.0,
        "e2e": result.e2e or 0.0,
        "output_tokens": float(result.output_tokens),
        "content_chunks": float(result.content_chunks),
        "itl_mean": sum(itl) / len(itl) if itl else math.nan,
    }
    for key, value in (result.server_timings or {}).items():
        row[f"server_{key}"] = value
    return {k: v for k, v in row.items() if math.isfinite(v)}


async def run_chat_load(
    spec: ChatLoadSpec, clock: Callable[[], float] = time.perf_counter
) -> ChatReport:
    """Drive ``spec.url + spec.path`` with streaming chat requests and report what users see;
    never raises for HTTP, stream or connection errors."""
    spec.check()
    target = spec.url.rstrip("/") + spec.path
    headers = {"content-type": "application/json", **spec.headers}
    rng = random.Random(spec.seed)
    results: list[ChatResult] = []
    counts = {"sent": 0}
    waited = [0.0]
    not_before = [0.0]
    started = clock()
    deadline = started + spec.duration if spec.duration is not None else math.inf
    budget = spec.requests if spec.requests is not None else math.inf
    open_loop = spec.rate is not None
    limit = spec.max_in_flight if open_loop else spec.concurrency
    # A connection per request: every simulated user is its own client, and a server that
    # closes its connection after a stream (llama.cpp's does) never meets a stale reused one
    # (aiohttp fails that request with "Can not write request body").
    connector = aiohttp.TCPConnector(limit=limit, force_close=True)
    timeout = aiohttp.ClientTimeout(total=spec.timeout, sock_read=spec.idle_timeout)

    async def honour(result: ChatResult) -> None:
        if result.status == 429 and spec.honour_retry_after and result.retry_after:
            delay = min(retry_after_seconds(result.retry_after), spec.max_retry_after)
            delay = max(0.0, min(delay, deadline - clock()))
            if open_loop:  # arrivals pause until then: the offered load backs off, once
                until = clock() + delay
                if until > not_before[0]:
                    waited[0] += until - max(not_before[0], clock())
                    not_before[0] = until
            else:
                waited[0] += delay
                await asyncio.sleep(delay)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(body: dict[str, Any]) -> None:
            result = await stream_chat(session, target, body, headers, clock=clock)
            results.append(result)
            await honour(result)

        if not open_loop:

            async def worker() -> None:
                while clock() < deadline and counts["sent"] < budget:
                    counts["sent"] += 1
                    await one(spec.body(rng))

            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        else:
            assert spec.rate is not None
            in_flight: set[asyncio.Task[None]] = set()
            slots = asyncio.Semaphore(spec.max_in_flight)
            due = started
            gaps = arrival_gaps(spec.rate, spec.arrivals, rng)

            async def bounded(body: dict[str, Any]) -> None:
                try:
                    await one(body)
                finally:
                    slots.release()

            while counts["sent"] < budget:
                due += next(gaps)
                while True:  # a 429 met while waiting pushes this arrival back too
                    due = max(due, not_before[0])
                    wait = due - clock()
                    if due >= deadline or wait <= 0:
                        break
                    await asyncio.sleep(wait)
                if due >= deadline:
                    break
                await slots.acquire()
                counts["sent"] += 1
                task = asyncio.ensure_future(bounded(spec.body(rng)))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.gather(*in_flight)
    elapsed = clock() - started
    return _report(spec, results, counts["sent"], elapsed, waited[0])


def _report(
    spec: ChatLoadSpec, results: list[ChatResult], sent: int, elapsed: float, waited: float
) -> ChatReport:
    ok = [r for r in results if r.status == 200 and r.error is None]
    errors: Counter[str] = Counter()
    for r in results:
        if r.error is not None:
            errors[r.error] += 1
        elif r.status not in (200, 429):
            errors[str(r.status)] += 1
    from_usage = sum(1 for r in ok if r.usage_tokens is not None)
    tokens = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    return ChatReport(
        label=spec.label,
        mode="open" if spec.rate is not None else "closed",
        offered_rate=spec.rate,
        arrivals=spec.arrivals if spec.rate is not None else None,
        concurrency=None if spec.rate is not None else spec.concurrency,
        prompt_tokens_dist=spec.prompt_tokens.describe(),
        output_tokens_dist=spec.output_tokens.describe(),
        seed=spec.seed,
        sent=sent,
        ok=len(ok),
        throttled=sum(1 for r in results if r.status == 429),
        errors=dict(errors),
        malformed_events=sum(r.malformed for r in results),
        elapsed=elapsed,
        request_rate=len(ok) / elapsed if elapsed > 0 else 0.0,
        output_tokens=tokens,
        output_token_rate=tokens / elapsed if elapsed > 0 else 0.0,
        prompt_tokens=sum(prompts) if prompts else None,
        tokens_from="usage"
        if ok and from_usage == len(ok)
        else ("chunks" if not from_usage else "mixed"),
        ttft=latency_stats([r.ttft for r in ok if r.ttft is not None]),
        itl=latency_stats([gap for r in ok for gap in r.itl]),
        e2e=latency_stats(e2e),
        e2e_histogram=histogram(e2e),
        retry_after_waited=waited,
        server_timed=[_timed_row(r) for r in ok[:MAX_TIMED_REQUESTS] if r.server_timings],
    )
