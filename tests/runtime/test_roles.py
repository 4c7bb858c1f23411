"""Deployments with roles (prefill/decode, or agg in the engine's sizes): spec rules and layout."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError

SGLANG = ["python", "-m", "sglang.launch_server", "--model-path", "/m"]


def _spec(roles: dict[str, Any], gpus_per_node: int = 8, **dep: Any) -> AllocationSpec:
    d = {"name": "pd", "engine": "sglang", "command": SGLANG, "roles": roles, **dep}
    return AllocationSpec.from_data(
        {
            "name": "a",
            "client": {"command": ["true"]},
            "gpus_per_node": gpus_per_node,
            "deployments": [d],
        }
    )


def _error(roles: dict[str, Any], gpus_per_node: int = 8, **dep: Any) -> str:
    with pytest.raises(SpecError) as caught:
        _spec(roles, gpus_per_node, **dep)
    return str(caught.value)


DEP4 = {"tensor_parallel": 4, "data_parallel": 4, "expert_parallel": 4, "dp_attention": True}


def test_two_packed_prefill_workers_and_a_two_node_decode_worker() -> None:
    # srt-slurm recipe A's shape on 8-GPU nodes, with a DEP16 decode worker over two nodes.
    roles = {
        "prefill": {"workers": 2, **DEP4},
        "decode": {"tensor_parallel": 16, "data_parallel": 16, "dp_attention": True},
    }
    spec = _spec(roles, kv_transfer="nixl")
    assert spec.total_nodes == 3
    plan = layout.plan(spec)
    (d,) = plan.deployments
    assert d.roles == ("prefill", "decode")
    first, second, third = d.nodes
    assert [(lane.role, lane.replica, lane.gpus) for lane in first.lanes] == [
        ("prefill", 0, (0, 1, 2, 3)),
        ("prefill", 1, (4, 5, 6, 7)),
    ]
    # each packed worker has its own HTTP, bootstrap and NCCL port
    assert [(lane.port, lane.bootstrap_port, lane.side_port) for lane in first.lanes] == [
        (18000, 18500, 20000),
        (18001, 18501, 20001),
    ]
    assert [
        (lane.rank, lane.port, lane.bootstrap_port) for lane in (*second.lanes, *third.lanes)
    ] == [
        (0, 18000, None),
        (1, None, None),
    ]
    assert {lane.rendezvous_node for lane in (*second.lanes, *third.lanes)} == {1}
    lay = layout.bind(plan, ["n0", "n1", "n2"], {"n1": "10.0.0.2"})
    assert lay.prefill_bootstraps(d) == [("http://n0:18000", 18500), ("http://n0:18001", 18501)]
    assert lay.role_head_urls(d, "decode") == ["http://10.0.0.2:18000"]
    assert [lane.process_id for lane in d.heads] == [
        "pd-prefill-00000-rank-00000",
        "pd-prefill-00001-rank-00000",
        "pd-decode-00000-rank-00000",
    ]


def test_workers_per_node_spreads_partial_workers_one_per_node() -> None:
    # srt-slurm's spread_workers: three TP=2 decode workers on three 4-GPU nodes
    roles = {
        "prefill": {"tensor_parallel": 2},
        "decode": {"workers": 3, "tensor_parallel": 2, "workers_per_node": 1},
    }
    spec = _spec(roles, gpus_per_node=4)
    assert spec.total_nodes == 4
    decode = layout.plan(spec).deployments[0].role_heads("decode")
    assert [(lane.rendezvous_node, lane.gpus) for lane in decode] == [
        (1, (0, 1)),
        (2, (0, 1)),
        (3, (0, 1)),
    ]


def test_agg_role_in_the_engines_own_sizes() -> None:
    # a recipe's agg worker: TP=8 over two 4-GPU nodes, which the classic shape cannot say
    spec = _spec({"agg": {"tensor_parallel": 8}}, gpus_per_node=4)
    (d,) = layout.plan(spec).deployments
    assert spec.total_nodes == 2 and d.roles == ("agg",)
    assert [lane.bootstrap_port for n in d.nodes for lane in n.lanes] == [None, None]
    argv = layout.lane_argv(spec.deployments[0], d.heads[0], "n0", bind_host="n0")
    assert "--disaggregation-mode" not in argv
    assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--nnodes") + 1] == "2"


def test_role_env_and_engine_variables_reach_the_lane() -> None:
    roles = {"prefill": {"env": {"SGLANG_X": "1"}}, "decode": {}}
    spec = _spec(roles, env={"SGLANG_HOST_IP": "site-value"})
    d = spec.deployments[0]
    heads = layout.plan(spec).deployments[0].heads
    # the deployment's own env wins over the engine's per-node variable; the role's env is added
    assert layout.lane_env(d, heads[0], "10.0.0.1") == {"SGLANG_X": "1"}
    assert layout.lane_env(d, heads[1], "10.0.0.2") == {}


@pytest.mark.parametrize(
    ("roles", "dep", "words"),
    [
        ({"prefill": {}}, {}, "roles.decode: is missing"),
        ({"agg": {}, "decode": {}}, {}, "roles.agg: an aggregated role beside"),
        ({"prefill": {}, "decode": {}}, {"replicas": 2}, "replicas: describes the classic"),
        ({"agg": {}}, {"kv_transfer": "nixl"}, "kv_transfer: is for a disaggregated"),
        ({"prefill": {}, "decode": {}}, {"kv_transfer": "carrier-pigeon"}, "use one of mooncake"),
        (
            {"prefill": {"tensor_parallel": 4, "gpus_per_worker": 8}, "decode": {}},
            {},
            "roles.prefill.gpus_per_worker: 8 GPUs, but its sizes need 4",
        ),
        (
            {"prefill": {"tensor_parallel": 12}, "decode": {}},
            {},
            "does not fill them: a worker over several nodes takes whole nodes",
        ),
        (
            {"prefill": {"tensor_parallel": 4, "workers_per_node": 3}, "decode": {}},
            {},
            "set workers_per_node to at most 2",
        ),
        (
            {"prefill": {"tensor_parallel": 16, "nodes_per_worker": 1}, "decode": {}},
            {},
            "roles.prefill.nodes_per_worker: 1, but a worker of 16 GPUs",
        ),
        (
            {"prefill": {"args": ["--tp-size=2"]}, "decode": {}},
            {},
            "roles.prefill.args: --tp-size (argument 0) is set by the launcher",
        ),
        (
            {"prefill": {"args": ["--hf-token", "hf_x"]}, "decode": {}},
            {},
            "--hf-token carries a credential",
        ),
        (
            {"prefill": {"env": {"HF_TOKEN": "x"}}, "decode": {}},
            {},
            "move HF_TOKEN to the deployment's env",
        ),
        (
            {"prefill": {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "decode": {}},
            {},
            "CUDA_VISIBLE_DEVICES is set by the runtime",
        ),
        (
            {"prefill": {"tensor_parallel": 4, "expert_parallel": 3}, "decode": {}},
            {},
            "expert_parallel=3 must divide tensor_parallel=4",
        ),
        (
            {"prefill": {"tensor_parallel": 4, "dp_attention": True}, "decode": {}},
            {},
            "needs data_parallel ≥ 2 dividing tensor_parallel",
        ),
        (
            {"prefill": {"engine_config": {"a": 1}}, "decode": {}},
            {},
            "engine sglang takes its settings as flags",
        ),
    ],
)
def test_bad_roles_name_the_field_and_the_fix(
    roles: dict[str, Any], dep: dict[str, Any], words: str
) -> None:
    message = _error(roles, **dep)
    assert words in message and " — " in message


def test_vllm_roles_follow_vllms_own_rules() -> None:
    base = {
        "name": "v",
        "engine": "vllm",
        "command": ["vllm", "serve", "/m"],
        "frontend": {"type": "vllm-router"},
    }

    def check(roles: dict[str, Any], **dep: Any) -> AllocationSpec:
        return AllocationSpec.from_data(
            {
                "name": "a",
                "client": {"command": ["true"]},
                "gpus_per_node": 4,
                "deployments": [{**base, "roles": roles, **dep}],
            }
        )

    # vLLM's expert-parallel group is TP × DP, and it has no DP-attention flag
    with pytest.raises(SpecError, match="expert_parallel: 4"):
        check({"prefill": {"data_parallel": 4, "expert_parallel": 2}, "decode": {}})
    with pytest.raises(SpecError, match="has no data-parallel attention"):
        check(
            {
                "prefill": {"tensor_parallel": 2, "data_parallel": 2, "dp_attention": True},
                "decode": {},
            }
        )
    own = ["--kv-transfer-config", '{"kv_connector":"MultiConnector","kv_role":"kv_both"}']
    with pytest.raises(SpecError, match="keep one: the role's own connector config"):
        check({"prefill": {"args": own}, "decode": {}}, kv_transfer="nixl")
    spec = check({"prefill": {"data_parallel": 4, "expert_parallel": 4, "args": own}, "decode": {}})
    d = spec.deployments[0]
    prefill, decode = layout.plan(spec).deployments[0].heads
    argv = layout.lane_argv(d, prefill, "n0", bind_host="n0")
    # the role's own connector is used as written; the default NIXL one goes to the other role
    assert argv.count("--kv-transfer-config") == 1 and argv[-1] == own[1]
    assert (
        "--enable-expert-parallel" in argv and argv[argv.index("--data-parallel-size") + 1] == "4"
    )
    other = layout.lane_argv(d, decode, "n1", bind_host="n1")
    config = other[other.index("--kv-transfer-config") + 1]
    assert config == '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    assert layout.lane_env(d, prefill, "10.0.0.1") == {
        "VLLM_HOST_IP": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "20000",
    }


def test_llamacpp_has_no_roles() -> None:
    with pytest.raises(SpecError, match="engine llamacpp has no role launch"):
        AllocationSpec.from_data(
            {
                "name": "a",
                "client": {"command": ["true"]},
                "deployments": [
                    {
                        "name": "l",
                        "engine": "llamacpp",
                        "command": ["llama-server"],
                        "roles": {"agg": {}},
                    }
                ],
            }
        )


def test_ports_of_roles_that_collide_are_refused() -> None:
    # the bootstrap block starting where the HTTP block is: the second prefill worker's HTTP
    # port 18001 is the first's bootstrap port
    message = _error(
        {"prefill": {"workers": 2, "tensor_parallel": 4}, "decode": {}}, bootstrap_base_port=18001
    )
    assert message.startswith("deployments[0].base_port: port 18001 on node 0 is also claimed by")
    assert "deployments[0].bootstrap_base_port — move one of the two port ranges apart" in message


# -- properties --------------------------------------------------------------------------------

SIZES = st.sampled_from([1, 2, 4, 8, 16])


@st.composite
def role_shapes(draw: st.DrawFn) -> dict[str, Any]:
    tp = draw(SIZES)
    role: dict[str, Any] = {"workers": draw(st.integers(1, 5)), "tensor_parallel": tp}
    if draw(st.booleans()) and tp > 1:
        role |= {"data_parallel": tp, "dp_attention": True, "expert_parallel": tp}
    elif draw(st.booleans()):
        role["data_parallel"] = draw(st.sampled_from([1, 2]))
    if draw(st.booleans()):
        role["workers_per_node"] = draw(st.integers(1, 3))
    return role


@settings(max_examples=60, deadline=None)
@given(
    prefill=role_shapes(),
    decode=role_shapes(),
    gpus_per_node=st.sampled_from([2, 4, 8]),
    dedicated=st.booleans(),
)
def test_every_valid_role_layout_shares_no_gpu_or_port_and_counts_its_nodes(
    prefill: dict[str, Any], decode: dict[str, Any], gpus_per_node: int, dedicated: bool
) -> None:
    data = {
        "name": "a",
        "client": {"command": ["true"], "dedicated_node": dedicated},
        "gpus_per_node": gpus_per_node,
        "deployments": [
            {
                "name": "pd",
                "engine": "sglang",
                "command": SGLANG,
                "roles": {"prefill": prefill, "decode": decode},
            }
        ],
    }
    try:
        spec = AllocationSpec.from_data(data)
    except SpecError as exc:
        assert all(" — " in line for line in str(exc).splitlines())
        return
    plan = layout.plan(spec)
    (d,) = plan.deployments
    assert plan.total_nodes == spec.total_nodes
    used = {n.node for n in d.nodes}
    # the role nodes are consecutive after the client's own node, and none is idle
    assert used == set(range(int(dedicated), plan.total_nodes))
    claims: dict[int, list[int]] = {plan.client_node: [d.endpoint_port]}
    for n in d.nodes:
        gpus = [g for lane in n.lanes for g in lane.gpus]
        assert len(gpus) == len(set(gpus)) and all(0 <= g < gpus_per_node for g in gpus)
        assert len({lane.role for lane in n.lanes}) == 1  # roles never share a node
        claims.setdefault(n.node, []).extend(p for lane in n.lanes for p in lane.opened_ports)
    for ports in claims.values():
        assert len(ports) == len(set(ports))
    for role_name, role in (("prefill", prefill), ("decode", decode)):
        heads = d.role_heads(role_name)
        assert [h.replica for h in heads] == list(range(role["workers"]))
        need = spec.deployments[0].worker_gpus(role_name)
        for head in heads:
            lanes = [
                lane
                for n in d.nodes
                for lane in n.lanes
                if lane.role == role_name and lane.replica == head.replica
            ]
            assert [lane.rank for lane in lanes] == list(range(head.worker_nodes))
            assert sum(len(lane.gpus) for lane in lanes) == need
            assert head.port is not None
            assert (head.bootstrap_port is not None) == (role_name == "prefill")
            argv = layout.lane_argv(spec.deployments[0], head, "h", bind_host="h")
            assert argv[argv.index("--disaggregation-mode") + 1] == role_name


@pytest.mark.parametrize("engine", ["vllm"])
def test_a_vllm_pd_pair_behind_the_endpoint_alone_is_refused_naming_its_router(engine: str) -> None:
    """slurmgate's endpoint pairs SGLang's way; vLLM's decode needs the prefill's
    kv_transfer_params, which only its router passes: without one, both lanes would prefill."""
    data = {
        "name": "a",
        "client": {"command": ["true"]},
        "gpus_per_node": 4,
        "deployments": [
            {
                "name": "v",
                "engine": engine,
                "command": ["vllm", "serve", "/m"],
                "roles": {"prefill": {}, "decode": {}},
            }
        ],
    }
    with pytest.raises(SpecError) as refused:
        AllocationSpec.from_data(data)
    message = str(refused.value)
    assert message.startswith("deployments[0].frontend: engine vllm's prefill and decode need")
    assert message.endswith("add frontend: {type: vllm-router}"), message
    data["deployments"][0]["frontend"] = {"type": "vllm-router"}
    assert AllocationSpec.from_data(data).deployments[0].frontend is not None


def test_haproxy_is_refused_where_the_endpoint_pairs_the_roles() -> None:
    roles = {"prefill": {}, "decode": {}}
    message = _error(roles, endpoint_data_plane="haproxy")
    assert "endpoint_data_plane" in message and "leave endpoint_data_plane at python" in message
    assert _spec(roles).deployments[0].endpoint_data_plane == "python"
    aggregated = _spec({"agg": {}}, endpoint_data_plane="haproxy")
    assert aggregated.deployments[0].endpoint_data_plane == "haproxy"
    assert "'python' or 'haproxy'" in _error({"agg": {}}, endpoint_data_plane="nginx")
