"""The completions load: closed-loop workers against one OpenAI-style path, counting 429s.

``run_load`` runs ``concurrency`` workers that each send one request at a time until
``duration`` seconds have passed or ``requests`` requests were sent in all, whichever comes
first. A 429 answer is counted as throttled and, when ``honour_retry_after`` is set, the worker
waits the answer's Retry-After (capped by ``max_retry_after``) before its next request, as a
well-behaved client does. Latency is measured per answered request, from sending to the last
byte of the body; for streamed requests the time to the first body chunk (time to first token)
is reported too.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from slurmgate.runtime.loadgen.report import percentile
from slurmgate.runtime.loadgen.workload import retry_after_seconds


@dataclass(frozen=True)
class LoadSpec:
    """What to send, how hard and for how long."""

    url: str
    path: str = "/v1/completions"
    concurrency: int = 8
    duration: float | None = 10.0
    requests: int | None = None
    body: dict[str, Any] = field(
        default_factory=lambda: {"model": "stub-model", "prompt": "hello", "max_tokens": 16}
    )
    timeout: float = 60.0
    honour_retry_after: bool = True
    max_retry_after: float = 30.0

    def check(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.duration is None and self.requests is None:
            raise ValueError("set duration or requests (or both), or the run would never end")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration must be > 0 seconds")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")


@dataclass
class LoadReport:
    """The outcome of one run; latencies in seconds."""

    sent: int
    ok: int
    throttled: int
    errors: dict[str, int]
    elapsed: float
    throughput: float
    latency_p50: float
    latency_p90: float
    latency_p99: float
    latency_max: float
    latency_mean: float
    first_byte_p50: float
    first_byte_p99: float
    retry_after_waited: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def run_load(spec: LoadSpec, clock: Callable[[], float] = time.perf_counter) -> LoadReport:
    """Drive ``spec.url + spec.path`` and report; never raises for HTTP or connection errors."""
    spec.check()
    target = spec.url.rstrip("/") + spec.path
    payload = json.dumps(spec.body).encode()
    headers = {"content-type": "application/json"}
    stream = bool(spec.body.get("stream"))
    latencies: list[float] = []
    first_bytes: list[float] = []
    errors: Counter[str] = Counter()
    counts = {"sent": 0, "throttled": 0}
    waited = [0.0]
    started = clock()
    deadline = started + spec.duration if spec.duration is not None else math.inf
    budget = spec.requests if spec.requests is not None else math.inf

    connector = aiohttp.TCPConnector(limit=spec.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while clock() < deadline and counts["sent"] < budget:
                counts["sent"] += 1
                sent_at = clock()
                try:
                    async with session.post(target, data=payload, headers=headers) as resp:
                        first_byte = None
                        if stream:
                            async for _ in resp.content.iter_any():
                                if first_byte is None:
                                    first_byte = clock()
                        else:
                            await resp.read()
                        status = resp.status
                        retry_after = resp.headers.get("retry-after")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    errors[type(exc).__name__] += 1
                    continue
                if status == 200:
                    done_at = clock()
                    latencies.append(done_at - sent_at)
                    first_bytes.append((first_byte or done_at) - sent_at)
                elif status == 429:
                    counts["throttled"] += 1
                    if spec.honour_retry_after and retry_after:
                        delay = min(retry_after_seconds(retry_after), spec.max_retry_after)
                        delay = max(0.0, min(delay, deadline - clock()))
                        waited[0] += delay
                        await asyncio.sleep(delay)
                else:
                    errors[str(status)] += 1

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    elapsed = clock() - started
    latencies.sort()
    first_bytes.sort()
    return LoadReport(
        sent=counts["sent"],
        ok=len(latencies),
        throttled=counts["throttled"],
        errors=dict(errors),
        elapsed=elapsed,
        throughput=len(latencies) / elapsed if elapsed > 0 else 0.0,
        latency_p50=percentile(latencies, 50),
        latency_p90=percentile(latencies, 90),
        latency_p99=percentile(latencies, 99),
        latency_max=latencies[-1] if latencies else math.nan,
        latency_mean=sum(latencies) / len(latencies) if latencies else math.nan,
        first_byte_p50=percentile(first_bytes, 50),
        first_byte_p99=percentile(first_bytes, 99),
        retry_after_waited=waited[0],
    )
