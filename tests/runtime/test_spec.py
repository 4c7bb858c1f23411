"""Spec validation: every bad spec names its field and the fix (no Slurm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError

from .conftest import example_data


def _error(data: dict) -> SpecError:
    with pytest.raises(SpecError) as info:
        AllocationSpec.from_data(data)
    return info.value


def test_example_needs_three_nodes_with_the_client_on_the_first() -> None:
    spec = AllocationSpec.from_data(example_data())
    assert spec.total_nodes == 3
    assert [d.nodes_for(spec.gpus_per_node) for d in spec.deployments] == [1, 2]


def test_replicas_that_do_not_fit_one_node_spill_to_more_nodes() -> None:
    data = example_data()
    data["deployments"][0]["tensor_parallel"] = 2  # 2 GPUs per node hold one TP2 lane
    assert AllocationSpec.from_data(data).total_nodes == 4


def test_dedicated_client_node_adds_one() -> None:
    data = example_data()
    data["client"]["dedicated_node"] = True
    assert AllocationSpec.from_data(data).total_nodes == 4


def test_unknown_key_is_named() -> None:
    data = example_data()
    data["deployments"][1]["tensor_paralel"] = 2
    err = _error(data)
    assert err.problems[0][0] == "deployments[1].tensor_paralel"
    assert "unknown key" in str(err) and "spelling" in str(err)


def test_gpu_shared_by_two_lanes() -> None:
    data = example_data()
    # 2 lanes on a node × TP2 = 4 GPUs, but the deployment uses 2 GPUs per node.
    data["deployments"][0].update(tensor_parallel=2, lanes_per_node=2)
    err = _error(data)
    assert err.problems[0][0] == "deployments[0].lanes_per_node"
    assert "shared by two lanes" in str(err)


def test_more_gpus_than_a_node_has() -> None:
    data = example_data()
    data["deployments"][0]["gpus_per_node"] = 9
    err = _error(data)
    assert err.problems[0][0] == "deployments[0].gpus_per_node"
    assert "a node has 8" in str(err)


@pytest.mark.parametrize("pp,npr", [(2, 1), (1, 2), (4, 2)])
def test_pipeline_parallel_must_match_nodes_per_replica(pp: int, npr: int) -> None:
    data = example_data()
    data["deployments"][1].update(pipeline_parallel=pp, nodes_per_replica=npr)
    err = _error(data)
    assert err.problems[0][0] == "deployments[1].pipeline_parallel"
    assert "nodes_per_replica" in err.problems[0][2]


def test_port_collision_across_deployments_on_the_shared_client_node() -> None:
    data = example_data()
    # pipe's endpoint lives on node 1, where chat's lanes listen on 18000-18001.
    data["deployments"][1]["endpoint_port"] = 18001
    err = _error(data)
    assert err.problems[0][0] == "deployments[1].endpoint_port"
    assert "deployments[0].base_port" in err.problems[0][1]


def test_lane_and_rendezvous_ports_collide_within_a_deployment() -> None:
    data = example_data()
    data["deployments"][1]["rendezvous_base_port"] = 18100
    err = _error(data)
    assert err.problems[0][0] == "deployments[1].rendezvous_base_port"


def test_same_ports_on_different_nodes_are_fine() -> None:
    data = example_data()
    data["deployments"][1]["base_port"] = 18000  # pipe runs on nodes 2-3, chat on node 1
    assert AllocationSpec.from_data(data).total_nodes == 3


def test_launcher_flags_and_runtime_env_are_rejected() -> None:
    data = example_data()
    data["deployments"][0]["command"] = ["vllm", "serve", "m", "--port=9000"]
    assert _error(data).problems[0][0] == "deployments[0].command"
    data = example_data()
    data["deployments"][0]["env"] = {"CUDA_VISIBLE_DEVICES": "0"}
    assert _error(data).problems[0][0] == "deployments[0].env"


def test_schema_version_and_missing_fields() -> None:
    data = example_data()
    data["schema_version"] = 2
    assert "use 1" in str(_error(data))
    data = example_data()
    del data["client"]
    err = _error(data)
    assert err.problems[0][:2] == ("client", "is required")


def test_from_yaml_reports_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        AllocationSpec.from_yaml(bad)
    with pytest.raises(SpecError, match="cannot read"):
        AllocationSpec.from_yaml(tmp_path / "missing.yaml")


def test_spec_is_a_prefect_friendly_json_schema() -> None:
    schema = AllocationSpec.model_json_schema()
    assert schema["additionalProperties"] is False
    assert "deployments" in schema["required"]


def test_cli_reports_a_bad_spec_without_a_traceback(tmp_path: Path) -> None:
    import yaml
    from typer.testing import CliRunner

    from slurmgate.cli.app import app

    data = example_data()
    data["deployments"][0]["gpus_per_node"] = 16
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    out = CliRunner().invoke(app, ["allocation", "run", str(path)])
    assert out.exit_code == 2
    assert "deployments[0].gpus_per_node: 16 GPUs per node but a node has 8" in out.output
    assert "Traceback" not in out.output


def test_client_cpus_default_is_left_to_the_allocation() -> None:
    # None: the run gives the client the seed's 32, clamped to what the allocation holds.
    assert AllocationSpec.from_data(example_data()).client.cpus is None
    data = example_data()
    data["client"]["cpus"] = 0
    assert _error(data).problems[0][0] == "client.cpus"


def test_expert_parallel_is_a_single_node_knob_over_the_tensor_parallel_gpus() -> None:
    from slurmgate.runtime.engines import layout

    data = example_data()
    chat = data["deployments"][0]
    chat.update(tensor_parallel=2, gpus_per_node=4, enable_expert_parallel=True)
    spec = AllocationSpec.from_data(data)
    p = layout.plan(spec)
    lane = p.deployments[0].nodes[0].lanes[0]
    argv = layout.lane_argv(spec.deployments[0], lane, "10.0.0.1", bind_host="10.0.0.1")
    assert "--enable-expert-parallel" in argv and lane.gpus == (0, 1)
    pipe_argv = layout.lane_argv(
        spec.deployments[1], p.deployments[1].nodes[0].lanes[0], "a", bind_host="a"
    )
    assert "--enable-expert-parallel" not in pipe_argv  # off by default, as in the seed

    data["deployments"][1]["enable_expert_parallel"] = True  # PP=2 across two nodes
    (field, message, _fix) = _error(data).problems[0]
    assert field.endswith("enable_expert_parallel") and "across nodes" in message
    data = example_data()
    data["deployments"][0]["enable_expert_parallel"] = True  # TP=1: a group of one GPU
    (field, message, _fix) = _error(data).problems[0]
    assert field.endswith("enable_expert_parallel") and "tensor_parallel=1" in message


@pytest.mark.parametrize("flag", ["--enable-expert-parallel", "--data-parallel-size=2"])
def test_the_command_cannot_set_flags_the_layout_owns(flag: str) -> None:
    data = example_data()
    data["deployments"][0]["command"] = ["vllm", "serve", "m", flag]
    (field, message, _fix) = _error(data).problems[0]
    assert field.endswith("command") and "set by the launcher" in message
