"""The two-node engine examples, rendered as the run launches them: every rank's argv and env.

What the launcher appends is pinned against each engine's documented flags:
- vLLM, multi-node without Ray (https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html):
  the same --tensor-parallel-size and --pipeline-parallel-size on every node, --nnodes,
  --node-rank, --master-addr and --master-port of the head, --headless on the other nodes;
  VLLM_HOST_IP (https://docs.vllm.ai/en/latest/configuration/env_vars.html) is the address a
  node advertises.
- SGLang (https://docs.sglang.ai/advanced_features/server_arguments.html,
  https://docs.sglang.ai/references/multi_node_deployment/multi_node.html): --tp-size,
  --pp-size, --nnodes, --node-rank and --dist-init-addr HEAD:PORT on every node, --host and
  --port for the HTTP server on node rank 0, --enable-metrics for /metrics; SGLANG_HOST_IP
  (https://docs.sglang.ai/references/environment_variables.html).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError

from .conftest import REPO

EXAMPLES = REPO / "examples" / "specs"
HOSTS = ["gpu-a", "gpu-b"]
ADDRESSES = {"gpu-a": "10.1.0.1", "gpu-b": "10.1.0.2"}


def _rendered(
    name: str, tmp_path: Path
) -> tuple[AllocationSpec, list[tuple[str, list[str], dict[str, str]]]]:
    spec = AllocationSpec.from_yaml(EXAMPLES / name)
    run = AllocationRun(spec, runs_root=tmp_path)
    run.layout = layout.bind(run.plan, HOSTS, ADDRESSES)
    (deployment,) = run.plan.deployments
    worker = run._worker_spec(deployment)
    lanes = [(n.host, lane.argv, lane.env) for n in worker.nodes for lane in n.lanes]
    return spec, lanes


def _tail(argv: list[str], command: list[str]) -> list[str]:
    assert argv[: len(command)] == command  # the spec's command comes first, untouched
    return argv[len(command) :]


def test_vllm_two_nodes_tp8_pp2(tmp_path: Path) -> None:
    spec, lanes = _rendered("vllm-2node.yaml", tmp_path)
    d = spec.deployments[0]
    assert (d.engine, spec.total_nodes, d.tensor_parallel, d.pipeline_parallel) == ("vllm", 2, 8, 2)
    (head_host, head, head_env), (follower_host, follower, follower_env) = lanes
    assert (head_host, follower_host) == ("gpu-a", "gpu-b")
    assert _tail(head, d.command) == [
        "--host", "10.1.0.1", "--port", "18000",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0",
        "--master-addr", "10.1.0.1", "--master-port", "19000",
        "--distributed-timeout-seconds", "1800",
    ]  # fmt: skip
    assert _tail(follower, d.command) == [
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.1.0.1", "--master-port", "19000",
        "--distributed-timeout-seconds", "1800", "--headless",
    ]  # fmt: skip
    assert head_env == {"VLLM_HOST_IP": "10.1.0.1"}
    assert follower_env == {"VLLM_HOST_IP": "10.1.0.2"}


def test_sglang_two_nodes_tp8_pp2(tmp_path: Path) -> None:
    spec, lanes = _rendered("sglang-2node.yaml", tmp_path)
    d = spec.deployments[0]
    assert (d.engine, spec.total_nodes, d.tensor_parallel, d.pipeline_parallel) == (
        "sglang",
        2,
        8,
        2,
    )
    (_, head, head_env), (_, follower, follower_env) = lanes
    assert _tail(head, d.command) == [
        "--host", "10.1.0.1", "--port", "18000",
        "--tp-size", "8", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.1.0.1:19000",
        "--dist-timeout", "1800", "--enable-metrics",
    ]  # fmt: skip
    assert _tail(follower, d.command) == [
        "--tp-size", "8", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.1.0.1:19000",
        "--dist-timeout", "1800", "--enable-metrics",
    ]  # fmt: skip
    assert head_env == {"SGLANG_HOST_IP": "10.1.0.1"}
    assert follower_env == {"SGLANG_HOST_IP": "10.1.0.2"}


@pytest.mark.parametrize("name", ["vllm-2node.yaml", "sglang-2node.yaml"])
def test_the_examples_probe_metrics_and_preflight_as_their_engine(
    name: str, tmp_path: Path
) -> None:
    spec, _ = _rendered(name, tmp_path)
    run = AllocationRun(spec, runs_root=tmp_path)
    run.layout = layout.bind(run.plan, HOSTS, ADDRESSES)
    worker = run._worker_spec(run.plan.deployments[0])
    # the checkpoint the command loads is checked on both nodes before anything starts
    assert worker.checked_paths() == ["/shared/models/Llama-3.1-405B-Instruct-FP8"]
    assert [n.ports for n in worker.nodes][1] == []  # node rank 1 serves no port
    # the client is today's loadgen in its streaming chat mode, at the deployment's endpoint
    assert "loadgen" in spec.client.command[-1] and "--chat" in spec.client.command[-1]
    assert '"$SLURMGATE_ENDPOINT_CHAT"' in spec.client.command[-1]


def test_a_lane_env_the_spec_sets_itself_is_left_to_the_spec(tmp_path: Path) -> None:
    spec = AllocationSpec.from_yaml(EXAMPLES / "vllm-2node.yaml")
    data = spec.model_dump(mode="json")
    data["deployments"][0]["env"]["VLLM_HOST_IP"] = "10.9.9.9"
    run = AllocationRun(AllocationSpec.from_data(data), runs_root=tmp_path)
    run.layout = layout.bind(run.plan, HOSTS, ADDRESSES)
    worker = run._worker_spec(run.plan.deployments[0])
    assert [lane.env for n in worker.nodes for lane in n.lanes] == [{}, {}]


def _dp_worker(tmp_path: Path, **dep: object) -> list[tuple[str, list[str], list[int]]]:
    data = AllocationSpec.from_yaml(EXAMPLES / "vllm-2node.yaml").model_dump(mode="json")
    d = data["deployments"][0]
    d.update({"tensor_parallel": 4, "pipeline_parallel": 1, **dep})
    spec = AllocationSpec.from_data(data)
    run = AllocationRun(spec, runs_root=tmp_path)
    run.layout = layout.bind(run.plan, HOSTS[: run.plan.total_nodes], ADDRESSES)
    worker = run._worker_spec(run.plan.deployments[0])
    tails = [
        (n.host, _tail(lane.argv, spec.deployments[0].command), lane.gpus)
        for n in worker.nodes
        for lane in n.lanes
    ]
    return tails


def test_vllm_data_parallel_over_two_nodes_renders_the_documented_flags(tmp_path: Path) -> None:
    # vLLM's internal load balancing over nodes
    # (https://docs.vllm.ai/en/latest/serving/data_parallel_deployment.html): node 0 gets
    # --data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address HEAD
    # --data-parallel-rpc-port PORT; node 1 the same with --headless and
    # --data-parallel-start-rank 2. Each rank is TP GPUs, so a node's process runs on 2 × 4.
    (head_host, head, head_gpus), (follower_host, follower, follower_gpus) = _dp_worker(
        tmp_path, data_parallel=4, nodes_per_replica=2, enable_expert_parallel=True
    )
    assert (head_host, follower_host) == ("gpu-a", "gpu-b")
    assert head == [
        "--host", "10.1.0.1", "--port", "18000",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
        "--data-parallel-size", "4", "--data-parallel-size-local", "2",
        "--data-parallel-address", "10.1.0.1", "--data-parallel-rpc-port", "19000",
        "--distributed-timeout-seconds", "1800", "--enable-expert-parallel",
    ]  # fmt: skip
    assert follower == [
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
        "--data-parallel-size", "4", "--data-parallel-size-local", "2",
        "--data-parallel-start-rank", "2",
        "--data-parallel-address", "10.1.0.1", "--data-parallel-rpc-port", "19000",
        "--distributed-timeout-seconds", "1800", "--headless", "--enable-expert-parallel",
    ]  # fmt: skip
    assert head_gpus == follower_gpus == list(range(8))
    # none of the TP × PP launch's flags: data-parallel ranks rendezvous through the RPC port
    assert "--master-addr" not in head + follower and "--nnodes" not in head + follower


def test_vllm_data_parallel_on_one_node_is_the_size_alone(tmp_path: Path) -> None:
    # "This will run DP=4, TP=2 on a single 8-GPU node: vllm serve $MODEL
    # --data-parallel-size 4 --tensor-parallel-size 2" (the same page); two such replicas of
    # DP 2 × TP 2 share an 8-GPU node, 4 GPUs each, behind the endpoint.
    lanes = _dp_worker(
        tmp_path, tensor_parallel=2, data_parallel=2, nodes_per_replica=1, replicas=2
    )
    assert [(host, gpus) for host, _, gpus in lanes] == [
        ("gpu-a", [0, 1, 2, 3]),
        ("gpu-a", [4, 5, 6, 7]),
    ]
    assert [argv for _, argv, _ in lanes] == [
        ["--host", "10.1.0.1", "--port", str(port),
         "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
         "--data-parallel-size", "2"]
        for port in (18000, 18001)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"engine": "sglang", "command": ["python", "-m", "sglang.launch_server"]},
         "data_parallel", "engine sglang has no data-parallel launch"),
        ({"engine": "custom", "command": ["stub"]}, "data_parallel", "engine custom"),
        ({"pipeline_parallel": 2}, "pipeline_parallel", "a data-parallel replica has one"),
        ({"data_parallel": 3}, "data_parallel", "do not spread evenly"),
        ({"tensor_parallel": 8}, "lanes_per_node", "data-parallel ranks × tensor_parallel"),
    ],
)  # fmt: skip
def test_data_parallel_refusals_name_the_field(
    tmp_path: Path, change: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(SpecError) as err:
        _dp_worker(tmp_path, **{"data_parallel": 4, "nodes_per_replica": 2, **change})
    (where, message, fix), *_ = err.value.problems
    assert where.endswith(field) and words in message and fix, (where, message)


def test_expert_parallel_across_pipeline_stages_is_still_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        _dp_worker(tmp_path, tensor_parallel=8, pipeline_parallel=2, enable_expert_parallel=True)
    (where, message, _fix), *_ = err.value.problems
    assert where.endswith("enable_expert_parallel") and "pipeline-parallel replica" in message
