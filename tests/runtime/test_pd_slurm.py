"""A 1P+1D deployment of the stub engine on the real cluster, through the PD endpoint.

One allocation (client node, one prefill node, one decode node): the client's completions, plain
and streamed, come back through the endpoint, each paired (the decode lane logs the bootstrap
room the prefill lane logged). Then the prefill worker dies (it crashes after its fifth
request) while the client still runs: the run fails fast and cleanup leaves nothing.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec import AllocationSpec

from .conftest import assert_no_orphans, job_gone

pytestmark = pytest.mark.slurm

CLIENT = r"""
import json, os, time, urllib.request
base = json.loads(os.environ["SLURMGATE_ENDPOINTS"])["pd"]

def post(payload):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()

out = {"plain": [post({"model": "stub", "prompt": f"p{i}", "max_tokens": 3}) for i in range(3)]}
out["stream"] = post({"model": "stub", "prompt": "s", "max_tokens": 3, "stream": True})
print("RESULT " + json.dumps(out), flush=True)
try:
    post({"model": "stub", "prompt": "last", "max_tokens": 1})  # the prefill's fifth: it dies
except Exception as exc:
    print(f"fifth request failed: {exc}", flush=True)
print("DYING", time.time(), flush=True)
time.sleep(60)  # the run must not wait for this
"""


def pd_spec() -> AllocationSpec:
    room_logs = {"SLURMGATE_STUB_LOG_ROOMS": "1"}
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "pd",
            "gpus_per_node": 8,
            "time_limit": "00:05:00",
            "client": {"command": ["python", "-c", CLIENT], "dedicated_node": True},
            "deployments": [
                {
                    "name": "pd",
                    "engine": "custom",
                    "command": ["python", "-m", "slurmgate.testbed.stub_server", "--model", "stub"],
                    "roles": {
                        "prefill": {"env": {**room_logs, "SLURMGATE_STUB_CRASH_AFTER": "5"}},
                        "decode": {"env": room_logs},
                    },
                    "base_port": 18700,
                    "endpoint_port": 17700,
                    "startup_timeout_s": 60,
                }
            ],
        },
        source="test",
    )


def test_one_prefill_one_decode_pairs_requests_and_a_dying_prefill_fails_fast(
    slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    run = AllocationRun(pd_spec(), runs_root=tmp_path / "runs", grace_s=5)
    try:
        with pytest.raises(RunFailed) as failed:
            run.run()
        ended = time.time()
    finally:
        assert_no_orphans(run.run_id)
    assert failed.value.phase == "client", str(failed.value)
    assert run.status == "failed" and run.cleaned
    assert job_gone(run.job_id)
    logs = {p.name: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    client = next(text for name, text in logs.items() if name.endswith("-client.log"))
    line = next(x for x in client.splitlines() if x.startswith("RESULT "))
    report: dict[str, Any] = json.loads(line[len("RESULT ") :])
    for status, kind, body in report["plain"]:
        assert (status, kind) == (200, "application/json")
        assert json.loads(body)["choices"][0]["text"] == "tok0 tok1 tok2 "
    status, kind, body = report["stream"]
    assert status == 200 and kind.startswith("text/event-stream")
    assert body.count("data: {") == 3 and body.rstrip().endswith("data: [DONE]")
    # every answer was paired: the decode lane confirmed exactly the rooms the prefill ran
    every = "\n".join(logs.values())
    prefilled = re.findall(r"prefill bootstrap_room (\d+)", every)
    decoded = re.findall(r"decode bootstrap_room (\d+)", every)
    assert len(set(prefilled[:4])) == 4 and decoded[:4] == prefilled[:4]
    # the prefill lane's death ends the run long before the client's 60 s sleep
    dying = float(next(x for x in client.splitlines() if x.startswith("DYING")).split()[1])
    assert ended - dying < 20, f"the run took {ended - dying:.1f}s to notice"
    assert "prefill" in str(failed.value)
