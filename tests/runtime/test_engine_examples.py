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

from slurmgate.runtime import layout
from slurmgate.runtime.run import AllocationRun
from slurmgate.runtime.spec import AllocationSpec

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
