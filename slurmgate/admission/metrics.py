"""Prometheus metrics of admission: each tick's board, blocked reasons, waits, quota and timing.

`AdmissionMetrics` holds prometheus-client collectors on a registry of its own; the reconcile
flow records every tick into the process-wide `METRICS` (`record_tick`, `record_failure`).
Where they are read: the served process (`deployments/serve.py --events --metrics-port N`,
whose ticks run in that process, so counters and histograms accumulate) answers `GET /metrics`;
under a worker, where each tick is a process of its own, `SLURMGATE_METRICS_TEXTFILE` makes
each tick write the exposition to a file for node_exporter's textfile collector (the gauges
are the last tick's; the counters and histograms then count that tick only).
`examples/grafana/admission-dashboard.json` charts them.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, write_to_textfile

from slurmgate.admission.model import Admit, Decisions
from slurmgate.admission.tick import TickLog, TickReport
from slurmgate.settings.admission import AdmissionMetricsSettings

PREFIX = "slurmgate"
TEXTFILE_ENV = "SLURMGATE_METRICS_TEXTFILE"
WAIT_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400)
TICK_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)


class AdmissionMetrics:
    """The admission's series; one instance per registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.wait = Histogram(
            f"{PREFIX}_queued_to_anchored_seconds",
            "From a job's creation (queued) to its anchor labels being written, per pool.",
            ["pool"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.blocked = Gauge(
            f"{PREFIX}_blocked_jobs",
            "Queued managed jobs that wait, by pool and reason (the board's).",
            ["pool", "reason"],
            registry=r,
        )
        self.leases = Gauge(
            f"{PREFIX}_leases", "Leases held, by pool (runner labels).", ["pool"], registry=r
        )
        self.leased_nodes = Gauge(
            f"{PREFIX}_leased_nodes",
            "Nodes the pool's leases hold (a lease's runners, or its nodes:N if larger).",
            ["pool"],
            registry=r,
        )
        self.runners = Gauge(
            f"{PREFIX}_runners", "Runners of the pool, online or not.", ["pool"], registry=r
        )
        self.online = Gauge(
            f"{PREFIX}_runners_online", "Online runners of the pool.", ["pool"], registry=r
        )
        self.free = Gauge(
            f"{PREFIX}_runners_free",
            "Runners of the pool free for a new lease (online, idle, unleased).",
            ["pool"],
            registry=r,
        )
        self.slurm_usable = Gauge(
            f"{PREFIX}_slurm_usable_nodes",
            "Nodes of the pool's partition that can run a managed job (Slurm's view); only "
            "for pools mapped to a partition whose cluster answered.",
            ["pool"],
            registry=r,
        )
        self.slurm_nodes = Gauge(
            f"{PREFIX}_slurm_nodes",
            "Nodes of the pool's partition, usable or not (Slurm's view).",
            ["pool"],
            registry=r,
        )
        self.cordoned = Gauge(
            f"{PREFIX}_pool_cordoned", "1 while the pool is cordoned.", ["pool"], registry=r
        )
        self.admissions = Counter(
            f"{PREFIX}_admissions",
            "Leases anchored (jobs admitted), by pool.",
            ["pool"],
            registry=r,
        )
        self.rollbacks = Counter(
            f"{PREFIX}_rollbacks", "Admissions unwound (lost a conflict, failed).", registry=r
        )
        self.releases = Counter(f"{PREFIX}_releases", "Leases released.", registry=r)
        self.tick_seconds = Histogram(
            f"{PREFIX}_tick_duration_seconds",
            "Wall time of a reconcile tick, read to last admission.",
            buckets=TICK_BUCKETS,
            registry=r,
        )
        self.ticks = Counter(f"{PREFIX}_ticks", "Reconcile ticks that ran to the end.", registry=r)
        self.tick_failures = Counter(
            f"{PREFIX}_tick_failures",
            "Reconcile ticks that failed, or ended with decisions that failed after retries.",
            registry=r,
        )
        self.last_tick = Gauge(
            f"{PREFIX}_last_tick_timestamp_seconds",
            "When the last tick ended (Unix time).",
            registry=r,
        )
        self.api_calls = Counter(
            f"{PREFIX}_github_requests", "GitHub API requests the ticks made.", registry=r
        )
        self.quota_left = Gauge(
            f"{PREFIX}_github_rate_limit_remaining",
            "GitHub's primary rate limit left (x-ratelimit-remaining, last seen).",
            registry=r,
        )
        self.quota_limit = Gauge(
            f"{PREFIX}_github_rate_limit",
            "GitHub's primary rate limit per hour (x-ratelimit-limit, last seen).",
            registry=r,
        )

    def record_tick(
        self,
        decisions: Decisions,
        *,
        anchored: Iterable[Admit] = (),
        rolled_back: int = 0,
        released: int = 0,
        failed: bool = False,
        duration_s: float | None = None,
        api_calls: int = 0,
        rate_limit: tuple[int, int] | None = None,
        now: datetime | None = None,
    ) -> None:
        """Everything one tick said: the board as gauges, its admissions, waits and timing.
        `rate_limit` is (remaining, limit) as GitHub last reported it."""
        self._board(decisions)
        stamp = now.timestamp() if now is not None else time.time()
        for admit in anchored:
            pool = admit.pool or "(legacy)"
            self.admissions.labels(pool).inc()
            if admit.created_at is not None:
                self.wait.labels(pool).observe(max(0.0, stamp - admit.created_at.timestamp()))
        if rolled_back:
            self.rollbacks.inc(rolled_back)
        if released:
            self.releases.inc(released)
        if duration_s is not None:
            self.tick_seconds.observe(duration_s)
        if api_calls:
            self.api_calls.inc(api_calls)
        if rate_limit is not None:
            self.quota_left.set(rate_limit[0])
            self.quota_limit.set(rate_limit[1])
        (self.tick_failures if failed else self.ticks).inc()
        self.last_tick.set(stamp)

    def record_report(
        self,
        report: TickReport | None,
        duration_s: float,
        *,
        api_calls: int = 0,
        rate_limit: tuple[int, int] | None = None,
        log: TickLog | None = None,
    ) -> None:
        """One tick as the reconcile flow saw it (None: it raised before it had a board), and
        then the exposition into $SLURMGATE_METRICS_TEXTFILE when that is set; a metrics
        problem never fails the tick (a write that fails is a warning on `log`)."""
        if report is None:
            self.record_failure(duration_s)
        else:
            self.record_tick(
                report.decisions,
                anchored=report.anchored,
                rolled_back=report.rolled_back,
                released=report.released,
                failed=bool(report.failures),
                duration_s=duration_s,
                api_calls=api_calls,
                rate_limit=rate_limit,
            )
        target = (AdmissionMetricsSettings.text("metrics_textfile") or "").strip()
        if target:
            try:
                self.write_textfile(target)
            except OSError as exc:
                if log is not None:
                    log.warning(
                        "metrics not written to %s (%s): check %s", target, exc, TEXTFILE_ENV
                    )

    def record_failure(self, duration_s: float | None = None) -> None:
        """A tick that raised before it had a board (GitHub refused the read, say)."""
        self.tick_failures.inc()
        if duration_s is not None:
            self.tick_seconds.observe(duration_s)

    def _board(self, decisions: Decisions) -> None:
        # the gauges say this tick's board: a pool or reason gone from it is dropped
        for gauge in (
            self.blocked,
            self.leases,
            self.leased_nodes,
            self.runners,
            self.online,
            self.free,
            self.slurm_usable,
            self.slurm_nodes,
            self.cordoned,
        ):
            gauge.clear()
        blocked: dict[tuple[str, str], int] = defaultdict(int)
        for b in decisions.blocked:
            blocked[(b.pool or "(none)", b.reason.value)] += 1
        for (pool, reason), count in blocked.items():
            self.blocked.labels(pool, reason).set(count)
        for row in decisions.board:
            self.runners.labels(row.pool).set(row.runners)
            self.online.labels(row.pool).set(row.online)
            self.free.labels(row.pool).set(row.free)
            self.leased_nodes.labels(row.pool).set(row.admitted_nodes)
            self.leases.labels(row.pool).set(row.leases)
            self.cordoned.labels(row.pool).set(1 if row.cordon else 0)
            if row.slurm_usable is not None and row.slurm_total is not None:
                self.slurm_usable.labels(row.pool).set(row.slurm_usable)
                self.slurm_nodes.labels(row.pool).set(row.slurm_total)

    def write_textfile(self, path: str | os.PathLike[str]) -> None:
        """The exposition into `path`, atomically (node_exporter's textfile collector)."""
        write_to_textfile(str(path), self.registry)


METRICS = AdmissionMetrics()
"""The process's admission metrics: what the reconcile flow records, what serve.py serves."""
