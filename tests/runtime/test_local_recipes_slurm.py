"""Shipped recipes with `--local` on the cluster: each framework's shape served by its stand-ins.

One recipe per framework and frontend: SGLang, vLLM and TensorRT-LLM behind Dynamo's frontend
(Dynamo's mocker in the workers' place), SGLang behind the real sglang-router (the stub server),
and plain `vllm serve` (Dynamo's mocker behind a Dynamo frontend of its own: the mocker serves
no HTTP itself). Each is mapped as `slurmgate allocation run --recipe R --local` maps it, run to
the end, and its client's plain and streamed chat completions must come back through the
endpoint; nothing of the run is left on any node.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.from_recipe import spec_from_recipe
from slurmgate.runtime.spec.local_recipe import localize

from .conftest import REPO, assert_no_orphans, job_gone

pytestmark = pytest.mark.slurm

DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
RECIPES = REPO / "tests" / "data" / "inferencex-recipes"
CASES = {
    "sglang-dynamo-1p1d": "sglang/qwen3.5/gb200-fp8/8k1k/1p1d-tp4-tp4.yaml",
    "sglang-router-agg": "sglang/qwen3.5/gb200-fp4/agentic/agg-gb200-tp4-mtp.yaml",
    "vllm-dynamo-2p1d": "vllm/deepseek-v4/8k1k/disagg-b200-2p1d-dep8-dep8-mtp.yaml",
    "vllm-serve-agg": "vllm/kimi-k3/agentic/agg-b200-tp8pp2-agentic.yaml",
    "trtllm-dynamo-3p1d": "trtllm/qwen3.5/gb300-fp4/disagg/8k1k/stp/"
    "ctx3dep2_gen1dep4_mtp0_c1536.yaml",
}


@pytest.mark.parametrize("relative", CASES.values(), ids=CASES.keys())
def test_a_shipped_recipe_runs_locally_through_its_stand_ins(
    relative: str,
    slurm_cluster: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not DYNAMO_PYTHON.exists():
        pytest.skip("no Dynamo venv (.venv-dynamo): scripts/setup.sh with SLURMGATE_WITH_DYNAMO=1")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    built = localize(
        spec_from_recipe(RECIPES / relative), dynamo_python=str(DYNAMO_PYTHON), source=relative
    )
    run = AllocationRun(built.spec, runs_root=tmp_path / "runs", grace_s=5)
    started = time.monotonic()
    try:
        run.run()
    finally:
        assert_no_orphans(run.run_id)
    took = time.monotonic() - started
    assert run.status == "succeeded" and run.cleaned and job_gone(run.job_id)
    logs = {p.name.split("-", 1)[1]: p.read_text() for p in run.run_dir.glob("[0-9][0-9]-*.log")}
    client = logs["client.log"]
    assert "client ok: 2 chats and a stream of" in client, client[-2000:]
    # every worker of the scaled shape was started: one lane per worker (none spans a node)
    deployment = built.spec.deployments[0]
    assert deployment.roles is not None
    serve = "".join(text for name, text in logs.items() if name.startswith("serve-"))
    for role_name, role in deployment.roles.items():
        for worker in range(role.workers):
            lane = f"{deployment.name}-{role_name}-{worker:05d}-rank-00000"
            assert f"started lane {lane} pid" in serve, (lane, serve[-2000:])
    print(f"{relative}: {took:.1f}s on {built.spec.total_nodes} node(s)")
