"""A TensorRT-LLM worker over several nodes as one MPI world: its layout, srun and ranks."""

from __future__ import annotations

from typing import Any

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.steps import node_worker
from slurmgate.runtime.steps.node_worker import LaneSpec, NodeSpec, PreflightFailed, WorkerSpec
from slurmgate.slurm import commands as slurm


def _spec(engine: str = "trtllm", **dep: Any) -> AllocationSpec:
    command = {
        "trtllm": ["trtllm-serve", "/models/dsr1"],
        "dynamo-trtllm": ["python3", "-m", "dynamo.trtllm", "--model-path", "/models/dsr1"],
        "sglang": ["python3", "-m", "sglang.launch_server", "--model-path", "/models/dsr1"],
    }[engine]
    roles = {
        "prefill": {"workers": 2, "tensor_parallel": 4},
        "decode": {"workers": 1, "tensor_parallel": 16},
    }
    frontend = {"type": "dynamo"} if engine.startswith("dynamo") else {"type": "sglang-router"}
    if engine == "trtllm":
        frontend = {"type": "trtllm-serve", "command": ["trtllm-serve", "disaggregated"]}
    return AllocationSpec.from_data(
        {
            "name": "a",
            "client": {"command": ["true"]},
            "gpus_per_node": 8,
            "deployments": [
                {
                    "name": "w",
                    "engine": engine,
                    "command": command,
                    "roles": roles,
                    "frontend": frontend,
                    **dep,
                }
            ],
        }
    )


@pytest.mark.parametrize("engine", ["trtllm", "dynamo-trtllm"])
def test_a_decode_worker_over_two_nodes_is_one_world_of_a_rank_per_gpu(engine: str) -> None:
    spec = _spec(engine)
    d = layout.plan(spec).deployments[0]
    (world,) = d.mpi_worlds()
    assert (world.head.role, world.head.rank, world.ranks_per_node, world.size) == (
        "decode",
        0,
        8,
        16,
    )
    assert len(world.nodes) == 2 and world.nodes[0] == world.head.rendezvous_node
    lanes = [lane for n in d.nodes for lane in n.lanes]
    # the prefill workers fit a node: one process each, no MPI step
    assert [lane.mpi for lane in lanes if lane.role == "prefill"] == [False, False]
    # MPI finds its peers itself: no rendezvous port is claimed for the world
    assert all(lane.rendezvous_port is None for lane in lanes if lane.mpi)
    argv = layout.lane_argv(spec.deployments[0], world.head, "10.0.0.2", bind_host="10.0.0.2")
    server = "trtllm-serve" if engine == "trtllm" else "python3"
    assert argv[:2] == ["trtllm-llmapi-launch", server], argv
    plan = layout.plan(spec)
    hosts = [f"n{i + 1}" for i in range(plan.total_nodes)]
    head_urls = layout.bind(plan, hosts).role_head_urls(d, "decode")
    assert head_urls == [f"http://n{world.head.rendezvous_node + 1}:{world.head.port}"]


def test_an_sglang_worker_over_two_nodes_keeps_a_process_per_node() -> None:
    d = layout.plan(_spec("sglang")).deployments[0]
    assert d.mpi_worlds() == ()
    decode = [lane for n in d.nodes for lane in n.lanes if lane.role == "decode"]
    assert len(decode) == 2 and decode[0].rendezvous_port is not None


def test_mpi_launch_is_the_deployments_own() -> None:
    spec = _spec(mpi_launch=["numactl", "-m", "0,1", "trtllm-llmapi-launch"])
    (world,) = layout.plan(spec).deployments[0].mpi_worlds()
    argv = layout.lane_argv(spec.deployments[0], world.head, "h", bind_host="h")
    assert argv[:5] == ["numactl", "-m", "0,1", "trtllm-llmapi-launch", "trtllm-serve"]


@pytest.mark.parametrize(
    ("value", "words"),
    [([], "at least 1 item"), ([""], "at least 1 character"), (["x"] * 17, "at most 16 items")],
)
def test_a_bad_mpi_launch_names_the_field(value: list[str], words: str) -> None:
    with pytest.raises(SpecError) as caught:
        _spec(mpi_launch=value)
    assert "mpi_launch" in str(caught.value) and words in str(caught.value)


def test_the_worlds_srun_is_pmix_with_a_task_per_gpu() -> None:
    argv = slurm.srun_argv(
        ["x"], job_id="7", nodelist=["n2", "n3"], step_name="s", tasks_per_node=8, mpi="pmix"
    )
    assert {"--ntasks=16", "--ntasks-per-node=8", "--mpi=pmix", "--nodes=2"} <= set(argv)
    plain = slurm.srun_argv(["x"], job_id="7", nodelist=["n2", "n3"], step_name="s")
    assert "--ntasks=2" in plain and not [a for a in plain if a.startswith("--mpi")]


def _world(hosts: list[str]) -> WorkerSpec:
    lane = LaneSpec(id="w-decode-00000-rank-00000", argv=["srv"], gpus=[0, 1], delay_s=0, env={})
    nodes = [NodeSpec(host=h, ports=[], lanes=[lane], address=h) for h in hosts]
    return WorkerSpec(
        run_id="r", name="w", gpus_per_node=2, model_path=None, grace_s=1, nodes=nodes
    )


def test_each_rank_runs_its_nodes_lane_named_by_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    monkeypatch.setenv("SLURM_PROCID", "11")
    lane = node_worker.rank_lane(_world(["n2", "n3"]))
    assert lane.id == "w-decode-00000-rank-00000-mpi-rank-00011" and lane.gpus == [0, 1]
    monkeypatch.setenv("SLURMD_NODENAME", "n9")
    with pytest.raises(PreflightFailed, match="rank 11 runs on n9, a node the MPI world's plan"):
        node_worker.rank_lane(_world(["n2", "n3"]))
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(PreflightFailed, match="SLURM_PROCID is not set"):
        node_worker.rank_lane(_world(["n9"]))
