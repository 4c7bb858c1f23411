"""Per-lane queue backpressure: sample each lane's queue depth, decide if it takes work.

The queue is two Prometheus gauges of the lane's engine: requests waiting and requests running
(vLLM's names by default; the endpoint's config carries the deployment's engine's names, see
``engines.EngineProfile.queue``).

Each lane has one background sampler task that scrapes the lane's Prometheus ``/metrics`` every
``interval`` seconds. Routing never waits on a scrape: it reads the cached sample.

Sampling is bounded and fails open. A scrape may take ``timeout`` seconds (and the reader bounds
the page's size); past that it is abandoned, counted as failed, and the next one is made. A lane
with no sample younger than ``stale_after`` has an unknown queue, and an unknown queue never
refuses work: a lane whose ``/metrics`` hangs, answers an error, sends a page too large or
unparsable, or lacks the queue metric keeps taking requests. Health probes and the circuit
breaker, not queue samples, take a dead lane out of rotation. A sampler never dies of a scrape
error, so the first good sample restores the limit; process-control exceptions
(KeyboardInterrupt, SystemExit, cancellation) are not swallowed.

Between samples the lane's count of requests sent upstream bridges the gap, as the SGLang gateway
does: when the last sample showed a queue (depth > 0) the backend was saturated, so every request
sent since then waits too and every request finished since then shortened the queue. The estimate
is ``depth + (sent_now - sent_at_sample)``. A saturated sample also teaches the lane its capacity:
the number of requests it was running then. Once that is known, a sample with no queue still
bounds a burst: ``running + (sent_now - sent_at_sample) - capacity`` requests would wait. Before
any saturation was seen the free slots are unknown, so the estimate stays at the sampled 0 rather
than guessing (guessing would shed load that an idle backend could take); the next sample, at most
``interval`` later, catches up.

Requests the endpoint holds while they wait for one of the lane's pooled connections are a queue
too, only on this side of the wire: they count as waiting, exactly (``Lane.held``: those held
here and those HAProxy holds, with ``--data-plane haproxy``).

A saturated vLLM serves its ``/metrics`` slowly. A page that comes within ``timeout`` is the
lane's real queue and is used, stamped when it came if it took longer than an interval (the busy
server built it when it got to the request). A scrape that timed out leaves the last sample in
force until it is stale, since a slow page is a sign of a busy lane; one that failed fast drops it
at once, since an error page says nothing about the queue. With ``timeout + interval`` under
``stale_after`` a lane that answers in time always has a fresh sample.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from slurmgate.runtime.endpoint.breaker import Breaker

WAITING_METRIC = "vllm:num_requests_waiting"
RUNNING_METRIC = "vllm:num_requests_running"


def underscore(name: str) -> str:
    """The spelling of a metric name without colons (how some exporters write it)."""
    return name.replace(":", "_")


def metrics_query(waiting: str = WAITING_METRIC, running: str = RUNNING_METRIC) -> str:
    """The /metrics query asking for only the two gauges, in both spellings.

    prometheus-client servers (vLLM's and SGLang's /metrics among them) honour name[] and send
    only these; a server that ignores the query (llama.cpp's) sends its whole page.
    """
    names = (waiting, underscore(waiting), running, underscore(running))
    return "?" + "&".join(f"name%5B%5D={name}" for name in dict.fromkeys(names))


METRICS_QUERY = metrics_query()
WAITING_METRIC_UNDERSCORE = underscore(WAITING_METRIC)
RUNNING_METRIC_UNDERSCORE = underscore(RUNNING_METRIC)

Clock = Callable[[], float]
MetricsReader = Callable[["Lane"], Awaitable[str | None]]


def queue_sample(
    metrics_text: str, waiting: str = WAITING_METRIC, running: str = RUNNING_METRIC
) -> tuple[float | None, float | None]:
    """(waiting, running): each summed over all its samples, None when the metric is absent.

    vLLM exposes one sample per engine (data-parallel rank) or model, SGLang one per DP rank;
    they are summed, never overwritten. An underscore spelling is used only when the colon form
    is absent, so a server that exports both is not counted twice. Non-finite and negative
    values are ignored.
    """
    # A vLLM page is ~100 KB of histograms: parsing all of it costs ~20 ms, 10 times a second,
    # per lane. Only the lines of the two families matter, so only they go to the parser.
    stems = {underscore(name).split("_", 1)[-1] for name in (waiting, running)}
    relevant = "\n".join(
        line for line in metrics_text.splitlines() if any(s in line for s in stems)
    )
    wanted = {waiting, underscore(waiting), running, underscore(running)}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(relevant + "\n"):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            value = float(sample.value)
            if math.isfinite(value) and value >= 0:
                sums[family.name] = sums.get(family.name, 0.0) + value
            else:
                sums.setdefault(family.name, 0.0)

    def pick(name: str) -> float | None:
        return sums[name] if name in sums else sums.get(underscore(name))

    return pick(waiting), pick(running)


def queue_depth(metrics_text: str, waiting: str = WAITING_METRIC) -> float | None:
    """Sum of the waiting gauge over all its samples, or None when it is absent."""
    return queue_sample(metrics_text, waiting)[0]


@dataclass(eq=False)
class Lane:
    """One backend (a lane head) as the endpoint sees it: local in-flight count and last sample."""

    index: int
    url: str
    # In a disaggregated deployment: "prefill" or "decode", and a prefill's bootstrap port.
    role: str | None = None
    bootstrap_port: int | None = None
    active: int = 0
    queued: int = 0  # of ``active``: held here, waiting for one of the lane's connections
    depth: float | None = None
    running: float | None = None
    capacity: float | None = None
    sampled_at: float = -math.inf
    active_at_sample: int = 0
    last_error: str | None = None
    samples_ok: int = 0
    samples_failed: int = 0
    samples_overdue: int = 0  # of ``samples_failed``: scrapes abandoned at their timeout
    requests: int = 0
    # What the compiled data plane (HAProxy, ``haproxy.py``) has on the lane, as last read:
    # in flight (queued included), queued for one of its connections, routed in all.
    plane_active: int = 0
    plane_queued: int = 0
    plane_routed: int = 0
    plane_answers: dict[str, int] = field(default_factory=dict)  # by status class ("2xx")
    health_failures: int = 0  # consecutive failed health probes
    health_ok: bool | None = None  # the last health probe's verdict (None: none answered yet)
    # attempts waiting for the lane's answer to start, and those of them the endpoint cut off
    awaiting: set[asyncio.Task[Any]] = field(default_factory=set)
    cut_off: set[asyncio.Task[Any]] = field(default_factory=set)
    breaker: Breaker = field(default_factory=Breaker)  # judges the lane by its answers

    @property
    def in_rotation(self) -> bool:
        """False once enough health probes in a row failed; the next passing probe restores it."""
        return self.health_failures < UNHEALTHY_AFTER

    @property
    def sent(self) -> int:
        """Requests in flight past the connection gate: what the backend itself has seen."""
        return self.active - self.queued + self.plane_active - self.plane_queued

    @property
    def held(self) -> int:
        """Requests held on this side of the wire for one of the lane's connections."""
        return self.queued + self.plane_queued

    def record_sample(
        self,
        depth: float | None,
        taken_at: float,
        active_then: int,
        running: float | None = None,
    ) -> None:
        self.depth = depth
        self.running = running
        if depth is not None and depth > 0 and running is not None and running > 0:
            # a queue means every slot was busy: what ran then is what the lane can run at once
            self.capacity = max(self.capacity or 0.0, running)
        self.sampled_at = taken_at
        self.active_at_sample = active_then
        self.last_error = None if depth is not None else "metric missing"
        self.samples_ok += 1

    def record_failure(self, error: BaseException) -> None:
        # Fail open at once: a scrape that failed fast says nothing about the queue.
        self.depth = None
        self.last_error = f"{type(error).__name__}: {error}"[:200]
        self.samples_failed += 1

    def record_timeout(self, timeout: float) -> None:
        """A scrape was abandoned: the last sample stays until it is stale (a busy lane's page
        is slow), and staleness then fails the lane open."""
        self.last_error = f"metrics scrape timed out after {timeout:g} s"
        self.samples_failed += 1
        self.samples_overdue += 1


# Two failed probes in a row, not one: a single slow answer of a busy lane is not an outage.
UNHEALTHY_AFTER = 2


@dataclass(frozen=True)
class QueuePolicy:
    """The per-lane limit: a lane whose fresh estimated queue exceeds max_waiting takes no work."""

    max_waiting: int = 128
    stale_after: float = 1.0

    def queue_unknown(self, lane: Lane, now: float) -> bool:
        """True while the lane has no fresh sample of its queue: its limit then fails open."""
        return lane.depth is None or now - lane.sampled_at > self.stale_after

    def estimated_depth(self, lane: Lane, now: float) -> float | None:
        """The lane's queue estimate now: the backend's (from a fresh sample) plus the requests
        held here for a connection. None when neither is known (fail-open)."""
        depth = lane.depth
        if depth is None or self.queue_unknown(lane, now):
            # Only the backend's side is unknown: the requests held here are counted exactly.
            held = lane.held
            return float(held) if held else None
        routed_since = lane.sent - lane.active_at_sample
        if depth > 0:
            backend = max(0.0, depth + routed_since)
        elif lane.capacity is not None and lane.running is not None:
            backend = max(0.0, lane.running + routed_since - lane.capacity)
        else:
            backend = 0.0
        return backend + lane.held

    def admits(self, lane: Lane, now: float) -> bool:
        depth = self.estimated_depth(lane, now)
        return depth is None or depth <= self.max_waiting


@dataclass
class Sampler:
    """The background sampler of one lane; ``run`` loops until cancelled. A scrape that takes
    longer than ``timeout`` seconds is abandoned."""

    lane: Lane
    read: MetricsReader
    interval: float = 0.1
    timeout: float = 0.5
    clock: Clock = field(default=time.monotonic)
    waiting_metric: str = WAITING_METRIC
    running_metric: str = RUNNING_METRIC

    async def sample_once(self) -> None:
        lane = self.lane
        taken_at, active_then = self.clock(), lane.sent
        bound = asyncio.timeout(self.timeout)
        try:
            async with bound:
                text = await self.read(lane)
            answered_at = self.clock()
            if answered_at - taken_at > self.interval:
                # A late page shows the queue as the backend saw it when it finally answered.
                taken_at, active_then = answered_at, lane.sent
            depth, running = (
                queue_sample(text, self.waiting_metric, self.running_metric)
                if text is not None
                else (None, None)
            )
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except Exception as exc:  # any scrape or parse error: fail open, keep sampling
            if bound.expired():  # whatever the reader made of our cancellation
                lane.record_timeout(self.timeout)
            else:  # the reader's own error, its own timeouts among them
                lane.record_failure(exc)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # A client library may turn our cancellation into its own error: stop anyway.
                raise asyncio.CancelledError from exc
        else:
            lane.record_sample(depth, taken_at, active_then, running)

    async def run(self) -> None:
        while True:
            started = self.clock()
            await self.sample_once()
            await asyncio.sleep(max(0.0, self.interval - (self.clock() - started)))


def start_samplers(samplers: list[Sampler]) -> list[asyncio.Task[None]]:
    """One task per lane, so a slow lane never delays the scrape of another."""
    return [
        asyncio.create_task(s.run(), name=f"sampler-{s.lane.index}-{s.lane.url}") for s in samplers
    ]
