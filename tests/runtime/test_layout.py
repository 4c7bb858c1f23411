"""Layout maths: GPU slices, ranks, rendezvous, ports, stagger and argv (no Slurm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import example_data


def _spec(**dep: object) -> AllocationSpec:
    d = {
        "name": "g",
        "command": ["vllm", "serve", "m"],
        "tensor_parallel": 4,
        "pipeline_parallel": 2,
        "nodes_per_replica": 2,
        "replicas": 2,
        "lead_boot_standoff_s": 30,
        "rank_launch_stagger_s": 2,
    }
    d.update(dep)
    return AllocationSpec.from_data(
        {"name": "golden", "client": {"command": ["true"]}, "deployments": [d]}
    )


def test_golden_two_node_tp4_pp2_layout() -> None:
    # The seed's golden example: GPUs 0-3 / 4-7, HTTP 18000/18001, rendezvous 19000/19001.
    spec = _spec()
    p = layout.plan(spec)
    assert p.total_nodes == 2
    lay = layout.bind(p, ["a", "b"], {"a": "10.0.0.1", "b": "10.0.0.2"})
    (d,) = p.deployments
    head, follower = d.nodes
    assert [lane.gpus for lane in head.lanes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [lane.port for lane in head.lanes] == [18000, 18001]
    assert [lane.port for lane in follower.lanes] == [None, None]
    assert [lane.rank for lane in follower.lanes] == [1, 1]
    assert [lane.rendezvous_port for lane in follower.lanes] == [19000, 19001]
    assert {lane.rendezvous_node for lane in follower.lanes} == {0}
    assert head.ports == (18000, 18001, 19000, 19001) and follower.ports == ()
    assert [lane.delay_s for lane in head.lanes] == [0.0, 32.0]  # standoff 30 + 1 × 2
    assert lay.head_urls(d) == ["http://10.0.0.1:18000", "http://10.0.0.1:18001"]
    argv = layout.lane_argv(
        spec.deployments[0], follower.lanes[1], "10.0.0.1", bind_host="10.0.0.2"
    )
    assert argv[:3] == ["vllm", "serve", "m"]
    assert "--headless" in argv and "--port" not in argv
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-port") + 1] == "19001"
    assert argv[argv.index("--master-addr") + 1] == "10.0.0.1"
    # a head binds its node's cluster address, never every interface
    head_argv = layout.lane_argv(
        spec.deployments[0], head.lanes[0], "10.0.0.1", bind_host="10.0.0.1"
    )
    assert head_argv[head_argv.index("--host") + 1] == "10.0.0.1"


def test_replicas_spill_to_more_node_groups_in_order() -> None:
    spec = _spec(replicas=5, lanes_per_node=2)
    p = layout.plan(spec)
    assert p.total_nodes == 6  # 3 groups × 2 nodes
    heads = p.deployments[0].heads
    assert [(h.replica, h.rendezvous_node, h.gpus[0]) for h in heads] == [
        (0, 0, 0),
        (1, 0, 4),
        (2, 2, 0),
        (3, 2, 4),
        (4, 4, 0),
    ]


def test_example_places_client_with_the_first_deployment() -> None:
    spec = AllocationSpec.from_data(example_data())
    p = layout.plan(spec)
    lay = layout.bind(p, ["n1", "n2", "n3"])
    chat, pipe = p.deployments
    assert lay.client_host == "n1"
    assert lay.nodelist(chat) == ["n1"] and lay.nodelist(pipe) == ["n2", "n3"]
    assert lay.endpoint_url(pipe) == "http://n1:17001"
    assert [n.position for n in pipe.nodes] == [0, 1]


def test_bind_rejects_a_wrong_node_count() -> None:
    p = layout.plan(AllocationSpec.from_data(example_data()))
    with pytest.raises(layout.LayoutError, match="needs 3"):
        layout.bind(p, ["n1", "n2"])


def test_launch_delay() -> None:
    assert layout.launch_delay(0, 60, 5) == 0
    assert layout.launch_delay(3, 60, 5) == 75


def test_the_client_is_handed_where_the_serving_processes_export_metrics(tmp_path: Path) -> None:
    from slurmgate.runtime.run.allocation_run import AllocationRun

    def handed(deployment: dict[str, object]) -> list[str]:
        spec = AllocationSpec.from_data(
            {
                "name": "m",
                "client": {"command": ["true"]},
                "gpus_per_node": 8,
                "deployments": [deployment],
            }
        )
        run = AllocationRun(spec, runs_root=tmp_path)
        hosts = [f"n{i}" for i in range(run.plan.total_nodes)]
        addresses = {h: f"10.0.0.{i + 1}" for i, h in enumerate(hosts)}
        run.layout = layout.bind(run.plan, hosts, addresses)
        return run.client_env()["AIPERF_SERVER_METRICS_URLS"].split(",")

    # Dynamo over mockers: the frontend's /metrics, then each mocker's status server
    mocked = handed(
        {
            "name": "dyn",
            "engine": "dynamo-sglang",
            "stand_in": "dynamo-mocker",
            "command": ["python", "-m", "dynamo.mocker", "--model-path", "/model"],
            "roles": {"prefill": {}, "decode": {"workers": 2}},
            "frontend": {"type": "dynamo", "port": 17840},
            "side_base_port": 21000,
        }
    )
    assert mocked[0] == "http://10.0.0.1:17840/metrics"
    assert len(mocked) == 4 and all(u.endswith("/metrics") for u in mocked)
    assert len({u.split("//")[1].split("/")[0] for u in mocked}) == 4  # one listener each
    # engines serve their own /metrics on their HTTP port: each replica's head
    served = handed({"name": "v", "command": ["vllm", "serve", "m"], "replicas": 2})
    assert served == ["http://10.0.0.1:18000/metrics", "http://10.0.0.1:18001/metrics"]
