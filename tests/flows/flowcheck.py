"""Helpers for the admission flow tests: job labels, fleet views and the lease invariants."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from slurmgate.admission.labels import (
    ATTEMPT_PREFIX,
    JOB_PREFIX,
    NODES_PREFIX,
    LabelError,
    LeaseLabel,
)
from slurmgate.admission.model import Runner, leases_from_fleet


def job_labels(nodes: int | str | None, score: str = "1.000", token: str = "t", pool: str = "a"):
    labels = ["self-hosted", f"cluster:{pool}", f"ci-job-{score}-{token}", "ci-attempt-1"]
    if nodes is not None:
        labels.append(f"nodes:{nodes}")
    return labels


def fleet(dump: dict[str, Any]) -> list[Runner]:
    """The emulator's runners as the model sees them."""
    return [
        Runner(
            id=r["id"],
            name=r["name"],
            online=r["status"] == "online",
            busy=r["busy"],
            labels=tuple(label["name"] for label in r["labels"]),
        )
        for r in dump["runners"]
    ]


def jobs_by_id(dump: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {j["id"]: j for j in dump["jobs"]}


def managed_on(runners: list[Runner]) -> dict[int, list[str]]:
    """runner id -> its managed labels (lease and job families)."""
    out: dict[int, list[str]] = {}
    for r in runners:
        labels = r.lease_labels + r.managed_job_labels()
        if labels:
            out[r.id] = labels
    return out


def lease_of_job(runners: list[Runner], job_id: int) -> list[int]:
    """Runner ids carrying a lease label of `job_id`."""
    ids = []
    for r in runners:
        for label in r.lease_labels:
            try:
                if LeaseLabel.parse(label).job_id == job_id:
                    ids.append(r.id)
            except LabelError:
                pass
    return sorted(ids)


def assert_invariants(dump: dict[str, Any]) -> None:
    """Per pool leased <= online; no runner in two leases; leases complete or gone; no strays."""
    runners = fleet(dump)
    by_id = {r.id: r for r in runners}
    leases, malformed = leases_from_fleet(runners)
    assert not malformed, malformed
    for r in runners:
        assert len(r.lease_labels) <= 1, f"runner {r.name} is in two leases: {r.lease_labels}"
        if r.managed_job_labels():
            assert r.lease_labels, f"stray job labels on {r.name}: {r.managed_job_labels()}"
    leased_per_pool: dict[str | None, int] = defaultdict(int)
    online_per_pool: dict[str | None, int] = defaultdict(int)
    for r in runners:
        online_per_pool[r.pool] += int(r.online)
    for lease in leases:
        assert lease.anchor_id is not None, f"lease {lease.label} has no anchor"
        anchor = by_id[lease.anchor_id]
        job_labels = anchor.managed_job_labels()
        assert any(label.startswith(JOB_PREFIX) for label in job_labels), lease
        assert any(label.startswith(ATTEMPT_PREFIX) for label in job_labels), lease
        nodes = [label for label in job_labels if label.startswith(NODES_PREFIX)]
        expected = int(nodes[0][len(NODES_PREFIX) :]) if nodes else 1
        assert lease.size == expected, f"lease {lease.label} holds {lease.size}, needs {expected}"
        assert lease.pool is not None or lease.size == 1, f"lease {lease.label} spans pools"
        leased_per_pool[lease.pool] += lease.size
    for pool, leased in leased_per_pool.items():
        assert leased <= online_per_pool[pool], f"{pool}: {leased} leased > online"


def wait_for(predicate: Any, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
