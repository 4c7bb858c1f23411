"""The endpoint's counters, and the Prometheus view /metrics gives of them and of every lane."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from slurmgate.runtime.endpoint.backpressure import Lane, QueuePolicy
from slurmgate.runtime.endpoint.config import EndpointConfig


@dataclass
class EndpointStats:
    """Counters of the endpoint itself, rendered by ``/metrics``."""

    requests: int = 0
    attempts: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    rejected_overload: int = 0
    rejected_too_large: int = 0
    rejected_buffer_full: int = 0
    rejected_unauthorized: int = 0
    rejected_body_timeout: int = 0
    rejected_head: int = 0  # heads the data plane refused: malformed, too large
    rejected_connections: int = 0  # connections answered 503 past --max-connections
    client_disconnects: int = 0
    broken_streams: int = 0
    pd_parse_failures: int = 0  # PD bodies whose parser process overran or died
    client_write_pauses: int = 0  # a client read its answer slower than it came
    lane_reads_paused: int = 0  # ... and the lane streaming that answer was paused for it


class Observed(Protocol):
    """What the collector reads of the endpoint."""

    config: EndpointConfig
    stats: EndpointStats
    lanes: list[Lane]
    policy: QueuePolicy

    def open_connections(self) -> int: ...


class StatsCollector(Collector):
    """The endpoint's counters and every lane's state, as metric families at each scrape."""

    def __init__(self, endpoint: Observed) -> None:
        self.endpoint = endpoint

    def collect(self) -> Iterator[Any]:
        ep = self.endpoint
        stats = ep.stats
        name = ep.config.name
        now = time.monotonic()

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["endpoint"])
            family.add_metric([name], value)
            return family

        forwarded = sum(lane.plane_routed for lane in ep.lanes)  # by HAProxy, if it runs
        yield counter(
            "slurmgate_endpoint_requests", "Requests received", stats.requests + forwarded
        )
        yield counter(
            "slurmgate_endpoint_haproxy_forwarded",
            "Requests HAProxy forwarded straight to a lane (--data-plane haproxy)",
            forwarded,
        )
        yield counter("slurmgate_endpoint_attempts", "Upstream attempts", stats.attempts)
        yield counter(
            "slurmgate_endpoint_overload_rejections",
            "429s answered because every lane was over its queue limit",
            stats.rejected_overload,
        )
        yield counter(
            "slurmgate_endpoint_too_large",
            "413s for bodies over the limit",
            stats.rejected_too_large,
        )
        yield counter(
            "slurmgate_endpoint_buffer_full",
            "429s because the request bodies held already filled --max-buffered-bytes",
            stats.rejected_buffer_full,
        )
        yield counter(
            "slurmgate_endpoint_unauthorized",
            "401s for a missing or wrong bearer token",
            stats.rejected_unauthorized,
        )
        yield counter(
            "slurmgate_endpoint_body_timeouts",
            "408s for request bodies not in within --body-timeout",
            stats.rejected_body_timeout,
        )
        yield counter(
            "slurmgate_endpoint_bad_heads",
            "400s, 414s and 431s for malformed or oversized request heads",
            stats.rejected_head,
        )
        yield counter(
            "slurmgate_endpoint_refused_connections",
            "Connections answered 503 because --max-connections were open",
            stats.rejected_connections,
        )
        open_now = GaugeMetricFamily(
            "slurmgate_endpoint_open_connections", "Client connections open", labels=["endpoint"]
        )
        open_now.add_metric([name], ep.open_connections())
        yield open_now
        yield counter(
            "slurmgate_endpoint_client_disconnects",
            "Requests abandoned by the client",
            stats.client_disconnects,
        )
        yield counter(
            "slurmgate_endpoint_broken_streams",
            "Responses cut because the backend broke mid-stream",
            stats.broken_streams,
        )
        yield counter(
            "slurmgate_endpoint_pd_parse_failures",
            "PD bodies answered 413 or 503 because their parse overran --pd-parse-timeout or "
            "the parser process died (each time a new process takes the next body)",
            stats.pd_parse_failures,
        )
        yield counter(
            "slurmgate_endpoint_client_write_pauses",
            "Times a client read its answer slower than it came, so writes to it paused",
            stats.client_write_pauses,
        )
        yield counter(
            "slurmgate_endpoint_lane_reads_paused",
            "Times the lane streaming an answer to such a client was paused until it caught up",
            stats.lane_reads_paused,
        )
        retries = CounterMetricFamily(
            "slurmgate_endpoint_retries", "Retries by reason", labels=["endpoint", "reason"]
        )
        for reason, count in sorted(stats.retries.items()):
            retries.add_metric([name, reason], count)
        yield retries
        statuses = CounterMetricFamily(
            "slurmgate_endpoint_responses", "Final statuses", labels=["endpoint", "status"]
        )
        for status, count in sorted(stats.statuses.items()):
            statuses.add_metric([name, str(status)], count)
        yield statuses
        classes = CounterMetricFamily(
            "slurmgate_endpoint_haproxy_responses",
            "Lanes' answers HAProxy passed on, by status class (--data-plane haproxy)",
            labels=["endpoint", "class"],
        )
        answered: Counter[str] = Counter()
        for lane in ep.lanes:
            answered.update(lane.plane_answers)
        for status_class, count in sorted(answered.items()):
            classes.add_metric([name, status_class], count)
        yield classes
        labels = ["endpoint", "backend"]
        active = GaugeMetricFamily("slurmgate_backend_active", "In-flight requests", labels=labels)
        routed = CounterMetricFamily("slurmgate_backend_requests", "Attempts routed", labels=labels)
        depth = GaugeMetricFamily(
            "slurmgate_backend_queue_depth", "Last sampled queue depth (NaN if none)", labels=labels
        )
        admitted = GaugeMetricFamily(
            "slurmgate_backend_open", "1 when the lane takes new requests", labels=labels
        )
        failed = CounterMetricFamily(
            "slurmgate_backend_sample_failures", "Failed queue-depth scrapes", labels=labels
        )
        overdue = CounterMetricFamily(
            "slurmgate_backend_sample_overdue",
            "Queue-depth scrapes abandoned at --metrics-timeout (also counted as failures)",
            labels=labels,
        )
        failed_open = GaugeMetricFamily(
            "slurmgate_backend_sample_failed_open",
            "1 while the lane has no queue sample younger than --stale-after, so its queue "
            "limit is not enforced (fail-open)",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "slurmgate_backend_sample_age_seconds",
            "Seconds since the lane's last answered queue sample (+Inf if none)",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "slurmgate_backend_queued",
            "Requests held here (or in HAProxy) waiting for one of the lane's connections",
            labels=labels,
        )
        rotation = GaugeMetricFamily(
            "slurmgate_backend_in_rotation", "1 while the lane's health probes pass", labels=labels
        )
        breaker_open = GaugeMetricFamily(
            "slurmgate_backend_breaker_open",
            "1 while the lane's circuit breaker keeps it out (open or probing)",
            labels=labels,
        )
        trips = CounterMetricFamily(
            "slurmgate_backend_breaker_trips", "Times the lane's breaker opened", labels=labels
        )
        for lane in ep.lanes:
            key = [name, lane.url]
            breaker_open.add_metric(key, 1.0 if lane.breaker.tripped else 0.0)
            trips.add_metric(key, lane.breaker.trips)
            overdue.add_metric(key, lane.samples_overdue)
            queued.add_metric(key, lane.held)
            rotation.add_metric(key, 1.0 if lane.in_rotation else 0.0)
            active.add_metric(key, lane.active + lane.plane_active)
            routed.add_metric(key, lane.requests)
            depth.add_metric(key, float("nan") if lane.depth is None else lane.depth)
            admitted.add_metric(key, 1.0 if ep.policy.admits(lane, now) else 0.0)
            failed.add_metric(key, lane.samples_failed)
            failed_open.add_metric(key, 1.0 if ep.policy.queue_unknown(lane, now) else 0.0)
            age.add_metric(key, now - lane.sampled_at)
        yield from (active, routed, depth, admitted, failed, overdue, failed_open, age)
        yield from (queued, rotation)
        yield from (breaker_open, trips)
