"""Per-lane queue backpressure: sample each lane's vLLM queue depth, decide if it takes work.

Each lane has one background sampler task that scrapes the lane's Prometheus ``/metrics`` every
``interval`` seconds with a bounded timeout. Routing never waits on a scrape: it reads the cached
sample. A missing metric, a failed scrape or a sample older than ``stale_after`` counts as open
(fail-open), and a sampler never dies of a scrape error, so the next good sample restores the
limit. Process-control exceptions (KeyboardInterrupt, SystemExit, cancellation) are not swallowed.

Between samples the lane's local in-flight count bridges the gap, as the SGLang gateway does: when
the last sample showed a queue (depth > 0) the backend was saturated, so every request routed since
then waits too and every request finished since then shortened the queue. The estimate is
``depth + (in_flight_now - in_flight_at_sample)``. A saturated sample also teaches the lane its
capacity: the number of requests it was running then. Once that is known, a sample with no queue
still bounds a burst: ``running + (in_flight_now - in_flight_at_sample) - capacity`` requests would
wait. Before any saturation was seen the free slots are unknown, so the estimate stays at the
sampled 0 rather than guessing (guessing would shed load that an idle backend could take); the
next sample, at most ``interval`` later, catches up.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

WAITING_METRIC = "vllm:num_requests_waiting"
WAITING_METRIC_UNDERSCORE = "vllm_num_requests_waiting"
RUNNING_METRIC = "vllm:num_requests_running"
RUNNING_METRIC_UNDERSCORE = "vllm_num_requests_running"
_STEMS = ("num_requests_waiting", "num_requests_running")
# prometheus-client servers (vLLM's /metrics among them) honour name[] and send only these.
METRICS_QUERY = "?" + "&".join(
    f"name%5B%5D={name}"
    for name in (
        WAITING_METRIC,
        WAITING_METRIC_UNDERSCORE,
        RUNNING_METRIC,
        RUNNING_METRIC_UNDERSCORE,
    )
)

Clock = Callable[[], float]
MetricsReader = Callable[["Lane"], Awaitable[str | None]]


def queue_sample(metrics_text: str) -> tuple[float | None, float | None]:
    """(waiting, running): each summed over all its samples, None when the metric is absent.

    vLLM exposes one sample per engine (data-parallel rank) or model; they are summed, never
    overwritten. An underscore spelling is used only when the colon form is absent, so a server
    that exports both is not counted twice. Non-finite and negative values are ignored.
    """
    # A vLLM page is ~100 KB of histograms: parsing all of it costs ~20 ms, 10 times a second,
    # per lane. Only the lines of the two families matter, so only they go to the parser.
    relevant = "\n".join(
        line for line in metrics_text.splitlines() if any(s in line for s in _STEMS)
    )
    sums: dict[str, float] = {}
    wanted = (WAITING_METRIC, WAITING_METRIC_UNDERSCORE, RUNNING_METRIC, RUNNING_METRIC_UNDERSCORE)
    for family in text_string_to_metric_families(relevant + "\n"):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            value = float(sample.value)
            if math.isfinite(value) and value >= 0:
                sums[family.name] = sums.get(family.name, 0.0) + value
            else:
                sums.setdefault(family.name, 0.0)

    def pick(colon: str, underscore: str) -> float | None:
        return sums[colon] if colon in sums else sums.get(underscore)

    return (
        pick(WAITING_METRIC, WAITING_METRIC_UNDERSCORE),
        pick(RUNNING_METRIC, RUNNING_METRIC_UNDERSCORE),
    )


def queue_depth(metrics_text: str) -> float | None:
    """Sum of ``vllm:num_requests_waiting`` over all its samples, or None when it is absent."""
    return queue_sample(metrics_text)[0]


@dataclass(eq=False)
class Lane:
    """One backend (a lane head) as the endpoint sees it: local in-flight count and last sample."""

    index: int
    url: str
    active: int = 0
    depth: float | None = None
    running: float | None = None
    capacity: float | None = None
    sampled_at: float = -math.inf
    active_at_sample: int = 0
    last_error: str | None = None
    samples_ok: int = 0
    samples_failed: int = 0
    requests: int = 0

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
        # Fail open at once: a scrape that failed says nothing about the queue.
        self.depth = None
        self.last_error = f"{type(error).__name__}: {error}"[:200]
        self.samples_failed += 1


@dataclass(frozen=True)
class QueuePolicy:
    """The per-lane limit: a lane whose fresh estimated queue exceeds max_waiting takes no work."""

    max_waiting: int = 128
    stale_after: float = 1.0

    def estimated_depth(self, lane: Lane, now: float) -> float | None:
        """The lane's queue estimate now, or None when there is no fresh sample (fail-open)."""
        if lane.depth is None or now - lane.sampled_at > self.stale_after:
            return None
        routed_since = lane.active - lane.active_at_sample
        if lane.depth > 0:
            return max(0.0, lane.depth + routed_since)
        if lane.capacity is not None and lane.running is not None:
            return max(0.0, lane.running + routed_since - lane.capacity)
        return 0.0

    def admits(self, lane: Lane, now: float) -> bool:
        depth = self.estimated_depth(lane, now)
        return depth is None or depth <= self.max_waiting


@dataclass
class Sampler:
    """The background sampler of one lane; ``run`` loops until cancelled."""

    lane: Lane
    read: MetricsReader
    interval: float = 0.1
    timeout: float = 0.2
    clock: Clock = field(default=time.monotonic)

    async def sample_once(self) -> None:
        lane = self.lane
        taken_at = self.clock()
        active_then = lane.active
        try:
            async with asyncio.timeout(self.timeout):
                text = await self.read(lane)
            depth, running = queue_sample(text) if text is not None else (None, None)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except Exception as exc:  # any scrape or parse error: fail open, keep sampling
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
