"""Per-lane backpressure through a logical endpoint on the real cluster (lanes on other nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import assert_no_orphans

pytestmark = pytest.mark.slurm

# The client runs on the client host and reports what it saw as one JSON line.
OVERLOAD_CLIENT = r"""
import json, os, threading, time, urllib.error, urllib.request
url = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["slow"]
body = json.dumps({"model": "stub", "prompt": "x", "max_tokens": 16}).encode()
seen, lock = [], threading.Lock()

def one():
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            row = (r.status, None)
    except urllib.error.HTTPError as e:
        row = (e.code, e.headers.get("Retry-After"))
    with lock:
        seen.append(row)

health = []
def probe():
    for _ in range(10):
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            health.append(r.status)
        time.sleep(0.1)

first = [threading.Thread(target=one) for _ in range(6)]  # 1 running + 2 waiting per lane
for t in first:
    t.start()
time.sleep(0.5)  # the samplers (every 100 ms) now see both queues
second = [threading.Thread(target=one) for _ in range(12)]
for t in second:
    t.start()
probe()
for t in first + second:
    t.join()
print("RESULT " + json.dumps({"seen": seen, "health": health}), flush=True)
"""


def overload_spec() -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "backpressure",
            "gpus_per_node": 8,
            "time_limit": "00:05:00",
            "client": {"command": ["python", "-c", OVERLOAD_CLIENT], "cpus": 1},
            "deployments": [
                {
                    "name": "slow",
                    "command": [
                        "python", "-m", "slurmgate.testbed.stub_server", "--model", "stub",
                        "--max-concurrency", "1",
                    ],
                    "tensor_parallel": 1,
                    "pipeline_parallel": 1,
                    "replicas": 2,
                    "nodes_per_replica": 1,
                    "gpus_per_node": 2,
                    "base_port": 18300,
                    "endpoint_port": 17300,
                    "startup_timeout_s": 60,
                    "distributed_timeout_s": 30,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                    "backpressure": {"max_waiting_requests": 0, "retry_after_s": 2},
                    "env": {"SLURMGATE_STUB_TOKENS_PER_SECOND": "20"},
                }
            ],
        },
        source="test",
    )  # fmt: skip


def test_overload_answers_429_with_retry_after_while_health_answers(runs_root: Path) -> None:
    run = AllocationRun(overload_spec(), runs_root=runs_root, grace_s=5)
    result = run.run()
    assert result.ok, result.error
    client_log = next(run.run_dir.glob("[0-9][0-9]-client.log")).read_text()
    line = next(x for x in client_log.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT ") :])
    statuses = [status for status, _ in report["seen"]]
    assert len(statuses) == 18
    assert statuses.count(200) >= 6, statuses  # the first wave queued on both lanes and was served
    throttled = [retry for status, retry in report["seen"] if status == 429]
    assert throttled, f"no 429 under overload: {statuses}"
    assert set(throttled) == {"2"}, throttled  # the configured Retry-After on our own 429
    assert set(statuses) <= {200, 429}, statuses
    assert report["health"] and set(report["health"]) == {200}  # /health answers while overloaded
    # the endpoint's own counters agree with what the client saw
    samples = {
        (sample.name, sample.labels.get("status")): sample.value
        for family in text_string_to_metric_families(result.endpoint_metrics["slow"])
        for sample in family.samples
    }
    assert samples[("slurmgate_endpoint_responses_total", "429")] == len(throttled)
    assert samples[("slurmgate_endpoint_overload_rejections_total", None)] == len(throttled)
    assert_no_orphans(run.run_id)
