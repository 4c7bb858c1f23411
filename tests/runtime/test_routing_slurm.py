"""Routing of the logical endpoint on the real cluster: retries, the 3-backend cap, Retry-After,
streaming, 413 and connect errors, with the endpoint on the client node and every lane elsewhere.

One allocation (about 10 s) serves every case. Lanes differ through a per-lane wrapper script, as
sites wrap `vllm serve`: it reads the lane id the node worker sets (`SLURMGATE_RUN_LANE`) and adds
stub knobs for that lane only. The client talks to the endpoints, and to the lanes' own /metrics
(whose request counters prove which backends a request reached), and prints one RESULT line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import assert_no_orphans

pytestmark = pytest.mark.slurm

FLAKY_PORT, DOWN_PORT = 18400, 18500
BODY_LIMIT = 100 * 1024 * 1024  # the endpoint's default --max-body-bytes
STREAM_TOKENS, TOKENS_PER_SECOND = 20, 20

CLIENT = r"""
import http.client, json, os, socket, sys, time, urllib.error, urllib.request
from urllib.parse import urlsplit
from prometheus_client.parser import text_string_to_metric_families

FLAKY_PORT, DOWN_PORT, BODY_LIMIT, STREAM_TOKENS = (int(a) for a in sys.argv[1:5])
eps = json.loads(os.environ["SLURMGATE_ENDPOINTS"])
out = {}

def post(base, payload, timeout=30):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Retry-After"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), e.read().decode()

def samples(base):
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]

def endpoint_counters(base):
    found = {}
    for s in samples(base):
        if s.name.startswith("slurmgate_"):
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())
                                   if k != "endpoint")
            found[key] = s.value
    return found

def backends(base, first_port):
    # lane heads by replica: the endpoint's metrics name them; ports are base_port + slot
    urls = {s.labels["backend"] for s in samples(base)
            if s.name == "slurmgate_backend_requests_total"}
    return {urlsplit(u).port - first_port: u for u in urls}

def answered(lane):
    return {s.labels["status"]: s.value for s in samples(lane)
            if s.name == "slurmgate_stub_requests_total"}

def health(base):
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

small = {"model": "stub", "prompt": "hi", "max_tokens": 1}

# -- "flaky": replica 0 answers 503, replica 1 is healthy, replica 2 loses its listener --------
flaky = eps["flaky"]
lanes = backends(flaky, FLAKY_PORT)
out["flaky_backends"] = sorted(lanes)

# 413: a body over the limit is refused from its Content-Length; no lane ever sees it
before = {r: answered(u) for r, u in lanes.items()}
ep_before = endpoint_counters(flaky)
parts = urlsplit(flaky)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
conn.putrequest("POST", "/v1/completions")
conn.putheader("Content-Type", "application/json")
conn.putheader("Content-Length", str(BODY_LIMIT + 1))
conn.endheaders(b"{" * 4096)
resp = conn.getresponse()
out["too_large"] = {"status": resp.status, "body": json.loads(resp.read())}
conn.close()
out["too_large"]["lanes_before"] = before
out["too_large"]["lanes_after"] = {r: answered(u) for r, u in lanes.items()}
out["too_large"]["endpoint_before"] = ep_before
out["too_large"]["endpoint_after"] = endpoint_counters(flaky)

# streaming: the first event must arrive long before the last
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
payload = dict(small, max_tokens=STREAM_TOKENS, stream=True)
t0 = time.monotonic()
conn.request("POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"})
resp = conn.getresponse()
buf, reads, first_event, done = b"", 0, None, None
while True:
    chunk = resp.read1(65536)
    if not chunk:
        break
    reads += 1
    buf += chunk
    if first_event is None and b"data: {" in buf:
        first_event = time.monotonic() - t0
    if b"data: [DONE]" in buf:
        done = time.monotonic() - t0
conn.close()
out["stream"] = {"status": resp.status, "type": resp.getheader("Content-Type"), "reads": reads,
                 "events": buf.count(b"data: "), "first_event_s": first_event, "done_s": done}

# connect error: replica 2 serves one request, then its listener closes while it lives on
lost = lanes[2]
out["direct_to_lost"] = post(lost, small)[0]
refused = False
deadline = time.monotonic() + 10
while time.monotonic() < deadline and not refused:
    try:
        socket.create_connection((urlsplit(lost).hostname, urlsplit(lost).port), timeout=2).close()
        time.sleep(0.1)
    except ConnectionRefusedError:
        refused = True
out["lost_refuses"] = refused
deadline = time.monotonic() + 10
while True:
    out["health_after_loss"] = health(flaky)
    if out["health_after_loss"][0] == 503 or time.monotonic() > deadline:
        break
    time.sleep(0.1)

# 503 and connect errors are retried on another replica: every request succeeds
before = {r: answered(lanes[r]) for r in (0, 1)}
ep_before = endpoint_counters(flaky)
out["retried"] = {"statuses": [post(flaky, small)[0] for _ in range(6)]}
out["retried"]["lanes_before"] = before
out["retried"]["lanes_after"] = {r: answered(lanes[r]) for r in (0, 1)}
out["retried"]["endpoint_before"] = ep_before
out["retried"]["endpoint_after"] = endpoint_counters(flaky)

# -- "down": four replicas that all answer 429; only replica 3 sends its own Retry-After ------
down = eps["down"]
lanes = backends(down, DOWN_PORT)
out["down_backends"] = sorted(lanes)
out["down"] = []
for _ in range(2):
    before = {r: sum(answered(u).values()) for r, u in lanes.items()}
    status, retry_after, body = post(down, small)
    after = {r: sum(answered(u).values()) for r, u in lanes.items()}
    out["down"].append({"status": status, "retry_after": retry_after,
                        "hits": {r: after[r] - before[r] for r in sorted(lanes)}})
out["down_endpoint"] = endpoint_counters(down)
print("RESULT " + json.dumps(out), flush=True)
"""


def per_lane(knobs: dict[int, str]) -> list[str]:
    """A server command whose extra stub flags depend on the lane's replica."""
    cases = "".join(
        f'  *-replica-{r:05d}-*) set -- "$@" {flags} ;;\n' for r, flags in knobs.items()
    )
    script = (
        f'case "$SLURMGATE_RUN_LANE" in\n{cases}esac\n'
        'exec python -m slurmgate.testbed.stub_server "$@"\n'
    )
    return ["sh", "-c", script, "stub-lane", "--model", "stub"]


def deployment(name: str, replicas: int, port: int, retry_after: int, **extra: Any) -> Any:
    return {
        "name": name,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "replicas": replicas,
        "lanes_per_node": replicas,
        "nodes_per_replica": 1,
        "gpus_per_node": replicas,
        "base_port": port,
        "endpoint_port": port - 1000,
        "startup_timeout_s": 60,
        "distributed_timeout_s": 30,
        "lead_boot_standoff_s": 0,
        "rank_launch_stagger_s": 0,
        "backpressure": {"retry_after_s": retry_after},
        **extra,
    }


def routing_spec() -> AllocationSpec:
    args = [str(a) for a in (FLAKY_PORT, DOWN_PORT, BODY_LIMIT, STREAM_TOKENS)]
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "routing",
            "gpus_per_node": 8,
            "time_limit": "00:05:00",
            # The client and both endpoints get node 0 to themselves: every lane is remote.
            "client": {"command": ["python", "-c", CLIENT, *args], "dedicated_node": True},
            "deployments": [
                deployment(
                    "flaky",
                    3,
                    FLAKY_PORT,
                    1,
                    command=per_lane(
                        {0: "--fail-rate 1 --fail-status 503", 2: "--close-listener-after 1"}
                    ),
                    env={"SLURMGATE_STUB_TOKENS_PER_SECOND": str(TOKENS_PER_SECOND)},
                ),
                deployment(
                    "down",
                    4,
                    DOWN_PORT,
                    3,
                    command=per_lane({3: "--fail-retry-after 7"}),
                    env={"SLURMGATE_STUB_FAIL_RATE": "1", "SLURMGATE_STUB_FAIL_STATUS": "429"},
                ),
            ],
        },
        source="test",
    )


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def routed(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One run of the routing spec; the client's RESULT and the run itself."""
    runs_root = tmp_path_factory.mktemp("routing") / "runs"
    run = AllocationRun(routing_spec(), runs_root=runs_root, grace_s=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SLURM_JOB_ID", raising=False)  # an owned allocation, never an attached one
        mp.delenv("SLURM_JOBID", raising=False)
        try:
            result = run.run()
        finally:
            assert_no_orphans(run.run_id)
    client_log = next(run.run_dir.glob("[0-9][0-9]-client.log")).read_text()
    line = next((x for x in client_log.splitlines() if x.startswith("RESULT ")), None)
    assert result.ok and line, f"{result.error}\n{client_log[-3000:]}"
    report = json.loads(line[len("RESULT ") :])
    return run, result, report


def test_lanes_run_on_other_nodes_than_the_endpoint(routed: Any) -> None:
    run, result, report = routed
    layout = run.layout
    assert layout is not None and len(set(result.hosts)) == 3
    for d in run.plan.deployments:
        assert layout.client_host not in layout.nodelist(d)
    assert report["flaky_backends"] == [0, 1, 2]
    assert report["down_backends"] == [0, 1, 2, 3]


def test_body_over_the_limit_is_413_and_no_backend_sees_it(routed: Any) -> None:
    report = routed[2]["too_large"]
    assert report["status"] == 413
    assert report["body"]["error"]["code"] == 413
    assert str(BODY_LIMIT) in report["body"]["error"]["message"]
    assert report["lanes_after"] == report["lanes_before"]
    ep_before, ep_after = report["endpoint_before"], report["endpoint_after"]
    assert _delta(ep_after, ep_before, "slurmgate_endpoint_too_large_total") == 1
    assert _delta(ep_after, ep_before, "slurmgate_endpoint_attempts_total") == 0


def test_a_stream_arrives_event_by_event_before_it_completes(routed: Any) -> None:
    stream = routed[2]["stream"]
    assert stream["status"] == 200 and stream["type"].startswith("text/event-stream")
    assert stream["events"] == STREAM_TOKENS + 1  # every token, then [DONE]
    generation_s = STREAM_TOKENS / TOKENS_PER_SECOND
    assert stream["done_s"] >= 0.9 * generation_s
    # Buffering would deliver the first event together with the last.
    assert stream["first_event_s"] < stream["done_s"] - 0.5 * generation_s, stream
    assert stream["reads"] > 1


def test_503_and_connect_errors_are_retried_on_another_replica(routed: Any) -> None:
    report = routed[2]
    # The lost replica served one request, then refused connections while its process lived on.
    assert report["direct_to_lost"] == 200
    assert report["lost_refuses"] is True
    assert report["health_after_loss"] == [503, {"backends_ready": 2, "backends": 3}]
    retried = report["retried"]
    assert retried["statuses"] == [200] * 6
    before, after = retried["lanes_before"], retried["lanes_after"]
    failed_503 = _delta(after["0"], before["0"], "503")
    assert failed_503 >= 1, retried  # replica 0 was tried and failed...
    assert _delta(after["0"], before["0"], "200") == 0
    assert _delta(after["1"], before["1"], "200") == 6  # ...and replica 1 answered every request
    ep_before, ep_after = retried["endpoint_before"], retried["endpoint_after"]
    retries_503 = _delta(ep_after, ep_before, "slurmgate_endpoint_retries_total|reason=503")
    retries_connect = _delta(ep_after, ep_before, "slurmgate_endpoint_retries_total|reason=connect")
    assert retries_503 == failed_503
    assert retries_connect >= 1, retried
    lost = next(k for k in ep_after if k.startswith("slurmgate_backend_requests_total|") and
                k.endswith(f":{FLAKY_PORT + 2}"))  # fmt: skip
    assert _delta(ep_after, ep_before, lost) == retries_connect
    assert _delta(ep_after, ep_before, "slurmgate_endpoint_responses_total|status=200") == 6


def test_overload_everywhere_tries_three_backends_and_keeps_retry_after(routed: Any) -> None:
    rows = routed[2]["down"]
    outcomes = set()
    for row in rows:
        assert row["status"] == 429, row
        hits = row["hits"]
        assert sorted(hits.values()) == [0, 1, 1, 1], row  # three distinct backends, no more
        tried_replica_3 = hits["3"] == 1
        # Replica 3 sends Retry-After: 7 and is kept; without it the configured 3 is added.
        assert row["retry_after"] == ("7" if tried_replica_3 else "3"), row
        outcomes.add(tried_replica_3)
    assert outcomes == {True, False}, rows  # both cases happened
    counters = routed[2]["down_endpoint"]
    assert counters["slurmgate_endpoint_attempts_total"] == 6
    assert counters["slurmgate_endpoint_retries_total|reason=429"] == 4
    assert counters["slurmgate_endpoint_responses_total|status=429"] == 2


def test_the_run_cleaned_up_after_routing(routed: Any) -> None:
    run, result, _ = routed
    record = json.loads(Path(result.record_path).read_text())
    assert record["status"] == "succeeded" and record["cleanup_complete"] is True
    assert run.cleaned
    assert_no_orphans(run.run_id)
