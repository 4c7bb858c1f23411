"""A real llama.cpp server as a deployment (`engine: llamacpp`) on the bundled Slurm cluster.

Two replicas of llama.cpp's own HTTP server (xllamacpp's wheel, started by
`slurmgate.testbed.llamacpp_server`) on a generated tiny GGUF (a model hub is out of reach here,
so `write_tiny_model` writes one), beside a stub deployment. One run checks what the runtime
relies on from a real engine: readiness waits through /health 503 while the model loads,
completions and an SSE stream go through the logical endpoint, a full server (one slot,
`-np 1`) makes the endpoint answer 429 with Retry-After from the engine's real /metrics, and
cleanup leaves nothing behind.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.steps import readiness
from slurmgate.testbed.llamacpp_server import launch_command
from slurmgate.testbed.tiny_gguf import MODEL_NAME, write_tiny_model

from .conftest import assert_no_orphans, job_gone, processes_with

pytestmark = pytest.mark.slurm

LLM_PORT = 18400
LONG_TOKENS = 400  # the model never ends early: each long request generates exactly this many

# The client runs on the client host and reports what it saw as one JSON line.
CLIENT = r"""
import json, os, threading, time, urllib.error, urllib.request
endpoints = json.loads(os.environ["SLURMGATE_ENDPOINTS"])
llm, stub = endpoints["llm"], endpoints["stub"]
MODEL, LONG = os.environ["TINY_MODEL"], int(os.environ["LONG_TOKENS"])

def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)

report = {"completions": [], "stub": None, "stream": None, "seen": [], "during": None}
for i in range(4):
    body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 16}
    with post(llm + "/v1/completions", body) as r:
        data = json.loads(r.read())
        report["completions"].append([r.status, data["usage"]["completion_tokens"],
                                      data["choices"][0]["text"]])
with post(stub + "/v1/completions", {"model": "stub", "prompt": "hi", "max_tokens": 4}) as r:
    report["stub"] = r.status

chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
        "stream": True}
with post(llm + "/v1/chat/completions", chat) as r:
    kind = r.headers.get("Content-Type", "")
    events = [line[6:].strip() for line in r.read().decode().splitlines()
              if line.startswith("data: ")]
report["stream"] = {"status": r.status, "type": kind, "events": events}

lock = threading.Lock()
def long_one(together=None):
    if together is not None:
        together.wait()  # the wave's requests go at once, within one sampling interval
    try:
        with post(llm + "/v1/completions",
                  {"model": MODEL, "prompt": "x", "max_tokens": LONG}) as r:
            row = [r.status, None]
    except urllib.error.HTTPError as e:
        row = [e.code, e.headers.get("Retry-After")]
    with lock:
        report["seen"].append(row)

# 1 running + 2 deferred per lane. Released together: started one by one on a loaded machine,
# a late one met a sample that already showed its lane's deferred requests, and got 429.
wave = threading.Barrier(6)
first = [threading.Thread(target=long_one, args=(wave,)) for _ in range(6)]
for t in first:
    t.start()
time.sleep(0.5)  # the samplers (every 100 ms) now see both lanes' deferred requests
with urllib.request.urlopen(llm + "/metrics", timeout=10) as r:
    report["during"] = r.read().decode()
second = [threading.Thread(target=long_one) for _ in range(6)]
for t in second:
    t.start()
for t in first + second:
    t.join()
print("RESULT " + json.dumps(report), flush=True)
"""


class RecordingRun(AllocationRun):
    """The real run; its prober also keeps every readiness answer it gave (URL, ok, why)."""

    answers: list[tuple[str, bool, str]]

    def open_prober(self, *args: Any, **kwargs: Any) -> readiness.Prober:
        return _Recording(super().open_prober(*args, **kwargs), self.answers)


class _Recording:
    def __init__(self, inner: readiness.Prober, answers: list[tuple[str, bool, str]]) -> None:
        self.inner, self.answers = inner, answers

    def probe(self, chains: list[Any], timeout: float) -> list[tuple[bool, str]]:
        results = self.inner.probe(chains, timeout)
        for chain, (ok, why) in zip(chains, results, strict=True):
            first = chain[0] if isinstance(chain[0], str) else chain[0]["url"]
            self.answers.append((first, ok, why))
        return results

    def fetch(self, url: str, headers: dict[str, str], timeout: float) -> str | None:
        return self.inner.fetch(url, headers, timeout)


def llamacpp_spec(model: Path) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "llamacpp",
            "gpus_per_node": 8,
            "time_limit": "00:05:00",
            "client": {
                "command": ["python", "-c", CLIENT],
                "cpus": 1,
                "env": {"TINY_MODEL": MODEL_NAME, "LONG_TOKENS": str(LONG_TOKENS)},
            },
            "deployments": [
                {
                    "name": "llm",
                    "engine": "llamacpp",
                    "command": [
                        *launch_command(model, parallel=1, ctx_size=512, threads=1),
                        "-a", MODEL_NAME,
                    ],
                    "replicas": 2,
                    "nodes_per_replica": 1,
                    "gpus_per_node": 1,
                    "base_port": LLM_PORT,
                    "endpoint_port": 17400,
                    "startup_timeout_s": 60,
                    "distributed_timeout_s": 30,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                    "backpressure": {"max_waiting_requests": 0, "retry_after_s": 2},
                },
                {
                    "name": "stub",
                    "command": ["python", "-m", "slurmgate.testbed.stub_server", "--model", "stub"],
                    "replicas": 1,
                    "gpus_per_node": 1,
                    "base_port": 18410,
                    "endpoint_port": 17401,
                    "startup_timeout_s": 60,
                    "distributed_timeout_s": 30,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                },
            ],
        },
        source="test",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def _samples(text: str) -> dict[tuple[str, str | None], float]:
    return {
        (s.name, s.labels.get("backend") or s.labels.get("status")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_two_llamacpp_replicas_serve_stream_shed_load_and_clean_up(
    runs_root: Path, tmp_path: Path
) -> None:
    # 300 000 extra vocabulary entries: llama.cpp takes about a second to load them, so the
    # readiness probes see /health answer 503 first; each token costs a few milliseconds.
    model = write_tiny_model(tmp_path / "tiny.gguf", extra_tokens=300_000)
    run = RecordingRun(llamacpp_spec(model), runs_root=runs_root, grace_s=5)
    run.answers = []
    result = run.run()
    assert result.ok, result.error
    assert len(set(result.hosts)) == 3

    # Readiness waited through the real /health: 503 while the model loaded, then 200.
    llm_answers = [a for a in run.answers if f":{LLM_PORT}/" in a[0]]
    assert llm_answers, run.answers
    whys = [why for _, _, why in llm_answers]
    assert "/health: HTTP 503" in whys, whys
    assert llm_answers[-1][1], whys

    client_log = next(run.run_dir.glob("[0-9][0-9]-client.log")).read_text()
    line = next(x for x in client_log.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT ") :])

    # Completions and an SSE stream through the logical endpoint, from the real engine.
    assert [c[:2] for c in report["completions"]] == [[200, 16]] * 4
    assert all(c[2] and c[2].isprintable() for c in report["completions"])
    assert report["stub"] == 200
    stream = report["stream"]
    assert stream["status"] == 200 and stream["type"].startswith("text/event-stream")
    assert stream["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in stream["events"][:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # Backpressure: both one-slot servers full, so the endpoint sheds load with our Retry-After.
    statuses = [status for status, _ in report["seen"]]
    assert len(statuses) == 12 and set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 6, statuses  # the first wave waited in llama.cpp and was served
    throttled = [retry for status, retry in report["seen"] if status == 429]
    assert throttled and set(throttled) == {"2"}, report["seen"]
    # ... decided from llama.cpp's own gauge: the endpoint sampled requests_deferred > 0 on both.
    during = _samples(report["during"])
    depths = {k[1]: v for k, v in during.items() if k[0] == "slurmgate_backend_queue_depth"}
    assert len(depths) == 2 and all(d >= 1 for d in depths.values()), depths
    opened = {k[1]: v for k, v in during.items() if k[0] == "slurmgate_backend_open"}
    assert set(opened.values()) == {0.0}, opened
    after = _samples(result.endpoint_metrics["llm"])
    assert after[("slurmgate_endpoint_overload_rejections_total", None)] == len(throttled)
    final_depths = [v for k, v in after.items() if k[0] == "slurmgate_backend_queue_depth"]
    assert len(final_depths) == 2 and not any(math.isnan(d) for d in final_depths)

    # Cleanup: the job is gone and no process of the run (or of the model) is left on any node.
    assert job_gone(result.job_id)
    assert_no_orphans(run.run_id)
    assert not processes_with(str(model))


def test_a_missing_model_fails_in_preflight_on_every_node_and_launches_nothing(
    runs_root: Path, tmp_path: Path
) -> None:
    # The llama.cpp profile reads the model from `-m`: a path no node has stops the run before
    # any server is started, instead of every lane failing its load after launch.
    missing = tmp_path / "absent" / "tiny.gguf"
    run = AllocationRun(llamacpp_spec(missing), runs_root=runs_root, grace_s=5)
    with pytest.raises(RunFailed) as info:
        run.run()
    assert info.value.phase == "preflight", str(info.value)
    message = str(info.value)
    assert "check model-path" in message and f"{missing} does not exist" in message
    assert [s.name for s in run.supervisor.steps if not s.name.startswith("preflight")] == []
    assert run.status == "failed" and run.cleaned
    assert job_gone(run.job_id)
    assert_no_orphans(run.run_id)
