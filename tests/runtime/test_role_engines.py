"""Role launches, frontends and services, each pinned to the engine's documentation or source.

- SGLang PD: https://docs.sglang.ai/advanced_features/pd_disaggregation.html (the role flag,
  the prefill bootstrap port, the transfer backend; multi-node `--dist-init-addr/--nnodes/
  --node-rank`); `ServerArgs` itself parses these argv in test_engine_parsers.py.
- vLLM PD: https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html (NixlConnector
  `kv_both` in `--kv-transfer-config`, `VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`).
- trtllm-serve: tensorrt_llm/commands/serve.py (`--tp_size`, `--pp_size`, `--ep_size`,
  `--config`), https://nvidia.github.io/TensorRT-LLM/features/disagg-serving.html.
- Dynamo: https://docs.nvidia.com/dynamo/latest/ and srt-slurm's builders
  (`--disaggregation-mode`, `--request-plane`, `--extra-engine-args`, `dynamo.frontend
  --http-port`, `ETCD_ENDPOINTS`, `NATS_SERVER`, `DYN_SYSTEM_PORT`).
- Routers: https://docs.sglang.ai/advanced_features/router.html, vllm-project/router.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from slurmgate.errors import InputError
from slurmgate.runtime.engines import frontends, layout, service_lanes, vllm_cpu
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.engines.roles import LANE_DIR
from slurmgate.runtime.spec.allocation import AllocationSpec


def _plan(
    engine: str, command: list[str], roles: dict[str, Any], gpus: int = 4, **dep: Any
) -> tuple[AllocationSpec, layout.Layout]:
    spec = AllocationSpec.from_data(
        {
            "name": "a",
            "client": {"command": ["true"]},
            "gpus_per_node": gpus,
            "deployments": [
                {"name": "pd", "engine": engine, "command": command, "roles": roles, **dep}
            ],
        }
    )
    p = layout.plan(spec)
    hosts = [f"n{i}" for i in range(p.total_nodes)]
    return spec, layout.bind(p, hosts, {h: f"10.0.0.{i + 1}" for i, h in enumerate(hosts)})


def _argv(spec: AllocationSpec, lay: layout.Layout, role: str, rank: int = 0) -> list[str]:
    (d,) = lay.plan.deployments
    lane = next(
        lane
        for n in d.nodes
        for lane in n.lanes
        if lane.role == role and lane.replica == 0 and lane.rank == rank
    )
    node = next(n.node for n in d.nodes if lane in n.lanes)
    master = lay.address(lane.rendezvous_node)
    return layout.lane_argv(spec.deployments[0], lane, master, bind_host=lay.address(node))


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sglang_prefill_and_decode_speak_sglangs_pd_flags() -> None:
    roles = {"prefill": {"tensor_parallel": 2}, "decode": {"tensor_parallel": 8}}
    spec, lay = _plan("sglang", ["python", "-m", "sglang.launch_server"], roles, kv_transfer="nixl")
    prefill, decode0, decode1 = (
        _argv(spec, lay, "prefill"),
        _argv(spec, lay, "decode"),
        _argv(spec, lay, "decode", 1),
    )
    assert _value(prefill, "--disaggregation-mode") == "prefill"
    assert _value(prefill, "--disaggregation-bootstrap-port") == "18500"
    assert _value(prefill, "--disaggregation-transfer-backend") == "nixl"
    assert _value(decode0, "--disaggregation-mode") == "decode"
    assert "--disaggregation-bootstrap-port" not in decode0  # decode asks the prefill's
    # the decode worker spans two 4-GPU nodes: SGLang's multi-node launch, head on node 1
    assert [_value(a, "--node-rank") for a in (decode0, decode1)] == ["0", "1"]
    assert _value(decode1, "--dist-init-addr") == "10.0.0.2:19000"
    assert _value(decode1, "--nnodes") == "2" and "--port" not in decode1
    assert _value(decode0, "--tp-size") == "8"


def test_vllm_nixl_roles_and_per_node_data_parallel() -> None:
    roles = {
        "prefill": {"data_parallel": 8, "expert_parallel": 8},  # DEP8 over two 4-GPU nodes
        "decode": {"tensor_parallel": 8},  # TP8 over two nodes: vLLM's multi-node executor
    }
    spec, lay = _plan("vllm", ["vllm", "serve", "/m"], roles, frontend={"type": "vllm-router"})
    head, follower = _argv(spec, lay, "prefill"), _argv(spec, lay, "prefill", 1)
    nixl = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
    assert _value(head, "--kv-transfer-config") == nixl
    assert json.loads(nixl) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert _value(follower, "--data-parallel-size-local") == "4"
    assert _value(follower, "--data-parallel-start-rank") == "4"
    assert _value(follower, "--data-parallel-address") == "10.0.0.1"
    assert "--headless" in follower and "--headless" not in head
    decode = _argv(spec, lay, "decode", 1)
    assert _value(decode, "--nnodes") == "2" and _value(decode, "--master-addr") == "10.0.0.3"
    assert "--data-parallel-size-local" not in decode and "--headless" in decode
    (d,) = lay.plan.deployments
    lane = d.role_heads("prefill")[0]
    env = layout.lane_env(spec.deployments[0], lane, "10.0.0.1")
    # NIXL listens on its side-channel port + the local DP rank: a block of data_parallel
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "20000" and lane.side_span == 8


def test_trtllm_worker_reads_its_llm_api_yaml() -> None:
    roles = {
        "prefill": {
            "tensor_parallel": 4,
            "expert_parallel": 4,
            "dp_attention": True,
            "data_parallel": 4,
            "engine_config": {"max_batch_size": 2, "kv_cache_config": {"dtype": "fp8"}},
        },
        "decode": {"tensor_parallel": 4},
    }
    spec, lay = _plan(
        "trtllm",
        ["trtllm-serve", "/m"],
        roles,
        kv_transfer="UCX",
        frontend={"type": "trtllm-serve"},
    )
    argv = _argv(spec, lay, "prefill")
    assert argv[argv.index("--tp_size") + 1] == "4" and _value(argv, "--ep_size") == "4"
    assert _value(argv, "--config") == f"{LANE_DIR}/trtllm-prefill.yaml"
    (d,) = lay.plan.deployments
    files = layout.lane_files(spec.deployments[0], d.role_heads("prefill")[0])
    config = json.loads(files["trtllm-prefill.yaml"])
    assert config["cache_transceiver_config"] == {"backend": "UCX"}
    assert config["enable_attention_dp"] is True and config["kv_cache_config"] == {"dtype": "fp8"}
    (frontend,) = service_lanes.service_launches(spec.deployments[0], lay, d)
    assert frontend.argv == ["trtllm-serve", "disaggregated", "-c", f"{LANE_DIR}/disagg.yaml"]
    disagg = json.loads(frontend.files["disagg.yaml"])
    assert disagg["context_servers"] == {"num_instances": 1, "urls": ["10.0.0.1:18000"]}
    assert disagg["generation_servers"]["urls"] == ["10.0.0.2:18000"]


def test_dynamo_workers_frontend_and_services() -> None:
    roles = {"prefill": {"workers": 2, "tensor_parallel": 2}, "decode": {"tensor_parallel": 4}}
    spec, lay = _plan(
        "dynamo-sglang",
        ["python3", "-m", "dynamo.sglang", "--model-path", "/model"],
        roles,
        frontend={"type": "dynamo", "args": ["--router-mode", "kv"]},
    )
    argv = _argv(spec, lay, "prefill")
    assert _value(argv, "--disaggregation-mode") == "prefill"
    assert _value(argv, "--request-plane") == "tcp"
    (d,) = lay.plan.deployments
    # the workers run on other nodes: etcd and NATS want the run's certificates
    pems = frontends.ServicePems("ca", "server", "server-key", "client", "client-key")
    etcd, nats, frontend = service_lanes.service_launches(spec.deployments[0], lay, d, pems)
    assert frontend.argv == [
        "python3",
        "-m",
        "dynamo.frontend",
        "--http-host",
        "10.0.0.1",
        "--http-port",
        "8000",
        "--router-mode",
        "kv",
    ]
    # NATS is the event plane too, over TLS (`tls://`); every listener of the frontend binds
    # the client node's address, its response-stream server on the port after its HTTP port
    assert frontend.env == {
        "ETCD_ENDPOINTS": "https://10.0.0.1:2379",
        "NATS_SERVER": "tls://10.0.0.1:4222",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "nats",
        **{k: "10.0.0.1" for k in ("DYN_TCP_RPC_HOST", "DYN_SYSTEM_HOST", "DYN_EVENT_PLANE_HOST")},
        "DYN_TCP_RESPONSE_STREAM_HOST": "10.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_PORT": "8001",
        **frontends.client_auth_env(),
    }
    # etcd's client takes the certificate as PEM text only: the node worker reads the lane's
    # files into these variables when it starts it; the launch holds file names, never PEM
    assert frontend.env_files == {
        "ETCD_AUTH_CA": "service-ca.pem",
        "ETCD_AUTH_CLIENT_CERT": "service-client.pem",
        "ETCD_AUTH_CLIENT_KEY": "service-client.key",
    }
    assert "client-key" not in json.dumps([frontend.env, frontend.argv, frontend.env_files])
    assert _value(etcd.argv, "--listen-client-urls") == "https://10.0.0.1:2379"
    assert _value(nats.argv, "-c") == f"{LANE_DIR}/nats.conf"
    assert "port: 4222" in nats.files["nats.conf"] and '"127.0.0.1:8222"' in nats.files["nats.conf"]
    assert [s.name for s in d.services] == ["etcd", "nats", "frontend"]
    # the workers find etcd through the step's env, the same on every node
    assert service_lanes.service_env(spec.deployments[0], lay)["ETCD_ENDPOINTS"].endswith(":2379")
    env = layout.lane_env(spec.deployments[0], d.role_heads("prefill")[1], "10.0.0.1")
    assert env["DYN_SYSTEM_PORT"] == "20003"  # slot 1: NCCL 20002, status 20003
    assert layout.expected_workers(spec.deployments[0], d) == {"prefill": 2, "decode": 1}
    assert not engines.profile("dynamo-sglang").lane_http


def test_dynamo_vllm_expects_one_instance_per_node_with_per_node_dp() -> None:
    roles = {"prefill": {"data_parallel": 4}, "decode": {"data_parallel": 8}}
    spec, lay = _plan(
        "dynamo-vllm",
        ["python3", "-m", "dynamo.vllm", "--model", "/model"],
        roles,
        frontend={"type": "dynamo"},
    )
    (d,) = lay.plan.deployments
    assert "--data-parallel-hybrid-lb" in _argv(spec, lay, "decode", 1)
    assert layout.expected_workers(spec.deployments[0], d) == {"prefill": 1, "decode": 2}


def test_pd_routers_are_told_each_prefill_with_its_bootstrap_port() -> None:
    roles = {"prefill": {"workers": 2, "tensor_parallel": 2}, "decode": {"tensor_parallel": 4}}
    spec, lay = _plan(
        "sglang",
        ["python", "-m", "sglang.launch_server"],
        roles,
        frontend={"type": "sglang-router"},
    )
    (d,) = lay.plan.deployments
    (router,) = service_lanes.service_launches(spec.deployments[0], lay, d)
    assert router.argv == [
        "python3",
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",
        "http://10.0.0.1:18000",
        "18500",
        "--prefill",
        "http://10.0.0.1:18001",
        "18501",
        "--decode",
        "http://10.0.0.2:18000",
        "--host",
        "10.0.0.1",
        "--port",
        "8000",
        "--prometheus-host",
        "127.0.0.1",  # nothing scrapes it: loopback, no longer the cluster address
        "--prometheus-port",
        "8001",
    ]
    # its metrics port is claimed on the client node like any other
    assert router.plan.ports == (8000, 8001)
    workers = service_lanes.frontend_workers(lay, d)
    vllm = frontends.frontend_argv("vllm-router", ["vllm-router"], [], "h", 8000, workers)
    assert vllm[1:6] == [
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://10.0.0.1:18000",
        "--prefill",
        "http://10.0.0.1:18001",
    ]


@pytest.mark.parametrize(
    ("name", "body", "expected", "ready"),
    [
        (
            "dynamo",
            {
                "instances": [
                    {"component": "prefill", "endpoint": "generate"},
                    {"component": "backend", "endpoint": "generate"},
                    {"component": "backend", "endpoint": "clear_kv_blocks"},
                ]
            },
            {"prefill": 1, "decode": 1},
            True,
        ),
        (
            "dynamo",
            {"instances": [{"component": "backend", "endpoint": "generate"}]},
            {"prefill": 1, "decode": 1},
            False,
        ),
        (
            "sglang-router",
            {"stats": {"prefill_count": 2, "decode_count": 1, "regular_count": 0}},
            {"prefill": 2, "decode": 1},
            True,
        ),
        (
            "vllm-router",
            {"stats": {"prefill_count": 1, "decode_count": 0}},
            {"prefill": 1, "decode": 1},
            False,
        ),
        ("sglang-router", {"stats": {"regular_count": 3}}, {"agg": 3}, True),
        ("sglang-router", "not json", {"agg": 1}, False),
    ],
)
def test_frontend_readiness_counts_workers_per_role(
    name: str, body: Any, expected: dict[str, int], ready: bool
) -> None:
    assert frontends.frontend_ready(name, 200, body, expected) is ready
    assert frontends.frontend_ready(name, 503, body, expected) is False


def test_service_readiness() -> None:
    assert frontends.service_ready("etcd", 200, {"health": "true"})
    assert not frontends.service_ready("etcd", 200, {"health": "false"})
    assert frontends.service_ready("nats", 200, None) and not frontends.service_ready(
        "nats", 500, None
    )


def test_frontend_ports_collide_with_the_endpoint_are_refused() -> None:
    from slurmgate.runtime.spec.errors import SpecError

    with pytest.raises(SpecError, match="port 17000 on node 0 is also claimed by"):
        _plan(
            "dynamo-sglang",
            ["python3", "-m", "dynamo.sglang"],
            {"agg": {}},
            frontend={"type": "dynamo", "port": 17000},
        )


def test_the_node_workers_are_told_each_roles_env_and_files_and_preflight_checks_the_router(
    tmp_path: Any,
) -> None:
    """What the runtime sends the node workers of a PD deployment: each lane its role's env
    and its engine's files, and the client node's preflight every port the router opens."""
    from slurmgate.runtime.run.allocation_run import AllocationRun

    roles = {
        "prefill": {"tensor_parallel": 2, "env": {"ONLY_PREFILL": "1"}},
        "decode": {"tensor_parallel": 4},
    }
    spec, lay = _plan(
        "trtllm", ["trtllm-serve", "/m"], roles, frontend={"type": "trtllm-serve", "port": 8100}
    )
    run = AllocationRun(spec, runs_root=tmp_path)
    run.layout = lay
    (d,) = lay.plan.deployments
    nodes = run._worker_spec(d).nodes
    prefill = next(lane for n in nodes for lane in n.lanes if "-prefill-" in lane.id)
    decode = next(lane for n in nodes for lane in n.lanes if "-decode-" in lane.id)
    assert prefill.env["ONLY_PREFILL"] == "1" and "ONLY_PREFILL" not in decode.env
    assert list(prefill.files) == ["trtllm-prefill.yaml"]
    assert f"{LANE_DIR}/trtllm-prefill.yaml" in prefill.argv
    assert 8100 in run._client_worker_spec().nodes[0].ports


def test_a_dynamo_mocker_stand_in_runs_the_mocker_in_each_role_worker() -> None:
    roles = {"prefill": {"args": ["--speedup-ratio", "0"]}, "decode": {}}
    mocker_head = ["venv/bin/python", "-m", "dynamo.mocker"]
    spec, lay = _plan(
        "dynamo-sglang", mocker_head, roles, stand_in="dynamo-mocker", frontend={"type": "dynamo"}
    )
    (d,) = lay.plan.deployments
    dspec = spec.deployments[0]
    prefill = d.role_heads("prefill")[0]
    argv = layout.lane_argv(dspec, prefill, "10.0.0.2", bind_host="10.0.0.2", model_dir="/m")
    assert argv == [
        *mocker_head,
        *("--model-path", "/m", "--model-name", "pd", "--disaggregation-mode", "prefill"),
        *("--speedup-ratio", "0"),
    ]
    # every listener on the node's address: the request plane on the lane's first side port,
    # the status server (/health, /metrics) on its second, where dynamo.sglang's would be
    env = layout.lane_env(dspec, prefill, "10.0.0.2")
    assert env["DYN_TCP_RPC_PORT"] == "20000" and env["DYN_SYSTEM_PORT"] == "20001"
    assert env["DYN_SYSTEM_HOST"] == env["DYN_TCP_RPC_HOST"] == "10.0.0.2"
    decode = d.role_heads("decode")[0]
    assert _value(layout.lane_argv(dspec, decode, "h", bind_host="h"), "--disaggregation-mode") == (
        "decode"
    )
    # a command of its own names the model; the run writes none
    given = [*mocker_head, "--model-path", "/models/tiny"]
    spec, lay = _plan(
        "dynamo-vllm", given, roles, stand_in="dynamo-mocker", frontend={"type": "dynamo"}
    )
    (d,) = lay.plan.deployments
    argv = layout.lane_argv(spec.deployments[0], d.role_heads("decode")[0], "h", bind_host="h")
    assert argv.count("--model-path") == 1 and _value(argv, "--model-path") == "/models/tiny"


def test_a_vllm_cpu_stand_in_loads_the_model_the_run_writes_with_its_python(
    tmp_path: Any,
) -> None:
    """vLLM on CPU in an agg worker's place: the lane's argv is vLLM's with `--model` after
    its head, and the controller writes the tiny Llama with weights with the command's
    python (tiny_hf --weights), once, in the run's directory, which preflight then checks."""
    from slurmgate.runtime.run.allocation_run import AllocationRun

    calls = tmp_path / "calls"
    python = tmp_path / "python"
    # a stand-in for the vLLM venv's python: it records its argv and writes a config
    python.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\nmkdir -p "$4" && echo {{}} > "$4/config.json"\n'
    )
    python.chmod(0o755)
    command = vllm_cpu.command(str(python), "tiny")
    roles = {"agg": {"tensor_parallel": 1}}
    spec, lay = _plan("vllm", command, roles, stand_in="vllm-cpu", env=dict(vllm_cpu.ENV))
    (d,) = lay.plan.deployments
    lane = d.nodes[0].lanes[0]
    argv = layout.lane_argv(spec.deployments[0], lane, "h", bind_host="10.0.0.1", model_dir="/m")
    assert argv[:5] == [str(python), "-m", vllm_cpu.MODULE, "--model", "/m"]
    assert argv[5:] == [
        *("--served-model-name", "tiny", *vllm_cpu.FLAGS, "--host", "10.0.0.1"),
        *("--port", "18000", "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1"),
    ]
    run = AllocationRun(spec, runs_root=tmp_path / "runs")
    run.layout = lay
    for _ in range(2):
        worker = run._worker_spec(d)
    model = str((run.run_dir / "vllm-model").resolve())
    assert calls.read_text().splitlines() == [f"-m slurmgate.testbed.tiny_hf --weights {model}"]
    assert _value(worker.nodes[0].lanes[0].argv, "--model") == model
    assert model in worker.model_paths
    # a command of its own names the model; the run writes none
    spec, lay = _plan("vllm", [*command, "--model", "/models/tiny"], roles, stand_in="vllm-cpu")
    (d,) = lay.plan.deployments
    argv = layout.lane_argv(spec.deployments[0], d.nodes[0].lanes[0], "h", bind_host="h")
    assert argv.count("--model") == 1 and _value(argv, "--model") == "/models/tiny"


@pytest.mark.parametrize(
    ("dep", "field"),
    [
        ({"engine": "sglang"}, "stand_in"),
        ({"engine": "dynamo-trtllm"}, "stand_in"),
        ({"engine": "dynamo-sglang", "side_base_port": 40000}, "side_base_port"),
        ({"engine": "dynamo-sglang", "stand_in": "vllm-cpu"}, "stand_in"),
        # no model given, and no Python to write one with
        ({"engine": "dynamo-sglang", "command": ["mocker"]}, "command"),
        ({"engine": "vllm", "stand_in": "vllm-cpu", "command": ["vllm-cpu"]}, "command"),
    ],
)
def test_a_stand_in_is_refused_where_it_cannot_stand_in(dep: dict[str, Any], field: str) -> None:
    data = {"stand_in": "dynamo-mocker", "frontend": {"type": "dynamo"}, **dep}
    if data["engine"] in ("sglang", "vllm"):
        del data["frontend"]
    command = data.pop("command", ["p", "-m", "dynamo.mocker"])
    roles = {"agg": {}} if data["engine"] == "vllm" else {"prefill": {}, "decode": {}}
    with pytest.raises(InputError) as refused:
        _plan(data.pop("engine"), command, roles, **data)
    assert field in str(refused.value), str(refused.value)


def test_file_discovery_drops_the_etcd_lane_and_tells_every_process() -> None:
    roles = {"prefill": {}, "decode": {}}
    frontend = {"type": "dynamo", "discovery": "file"}
    spec, lay = _plan("dynamo-sglang", ["p", "-m", "dynamo.sglang"], roles, frontend=frontend)
    (d,) = lay.plan.deployments
    assert [s.name for s in d.services] == ["nats", "frontend"]
    env = service_lanes.service_env(spec.deployments[0], lay)
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and "ETCD_ENDPOINTS" not in env
    assert env["DYN_EVENT_PLANE"] == "nats"


@pytest.mark.parametrize(
    ("frontend", "field"),
    [
        ({"type": "sglang-router", "discovery": "file"}, "frontend.discovery"),
        ({"type": "dynamo", "discovery_dir": "/shared"}, "frontend.discovery_dir"),
        ({"type": "dynamo", "discovery": "file", "discovery_dir": "shared"}, "discovery_dir"),
    ],
)
def test_discovery_settings_are_refused_where_they_mean_nothing(
    frontend: dict[str, Any], field: str
) -> None:
    engine = "sglang" if frontend["type"] == "sglang-router" else "dynamo-sglang"
    with pytest.raises(InputError) as refused:
        _plan(engine, ["p", "-m", "x"], {"prefill": {}, "decode": {}}, frontend=frontend)
    assert field in str(refused.value), str(refused.value)
