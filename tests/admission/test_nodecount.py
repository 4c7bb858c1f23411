"""Node count of a deployment matrix row: the seed's fixtures (docs/seed.md), the real job mix."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from slurmgate.ci.nodecount import NodeCountError, gpus_per_node, node_count

RECIPES = Path(__file__).resolve().parent / "data" / "recipes"
MIX = Path(__file__).resolve().parents[2] / "slurmgate" / "data" / "inferencex-job-mix.csv"
HARDWARE = {"cluster:b300-nv": 8, "b300": 8, "gb200": 4, "cluster:gb200-nv": 4, "h100": 8}
KIMI = "CONFIG_FILE=recipes/vllm/kimi-k2.5-fp4/8k1k/disagg-gb200-3p1d-dep4-dep16.yaml"


def role(workers: int, tp: int, *settings: str, **extra: Any) -> dict[str, Any]:
    return {"num-worker": workers, "tp": tp, "additional-settings": list(settings), **extra}


def disagg(prefill: dict[str, Any], decode: dict[str, Any], runner: str = "b300") -> dict[str, Any]:
    return {
        "runner": runner,
        "multinode": True,
        "disagg": True,
        "prefill": prefill,
        "decode": decode,
    }


def test_explicit_num_nodes() -> None:
    row = {"runner": "b300", "multinode": True, "disagg": False, "num-nodes": 3}
    assert node_count(row, HARDWARE) == 3


def test_num_nodes_on_disaggregated_entry_is_an_error() -> None:
    row = {**disagg(role(1, 8), role(1, 8)), "num-nodes": 3}
    with pytest.raises(NodeCountError, match="num-nodes is not valid for disaggregated entries"):
        node_count(row, HARDWARE)


def test_num_nodes_on_single_node_entry_is_an_error() -> None:
    with pytest.raises(NodeCountError, match="only valid when multinode=true and disagg=false"):
        node_count({"runner": "b300", "multinode": False, "num-nodes": 2}, HARDWARE)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3"])
def test_num_nodes_must_be_a_positive_integer(bad: object) -> None:
    row = {"runner": "b300", "multinode": True, "disagg": False, "num-nodes": bad}
    with pytest.raises(NodeCountError, match="num-nodes must be a positive integer"):
        node_count(row, HARDWARE)


def test_topology_per_role_on_b300() -> None:
    row = disagg(role(3, 2), role(2, 8), runner="cluster:b300-nv")
    assert node_count(row, HARDWARE) == 1 + 2


def test_pp_and_pcp_multiply_the_gpu_footprint() -> None:
    row = disagg(role(1, 4, pp=2), role(1, 2, **{"pcp-size": 8}), runner="b300")
    assert node_count(row, HARDWARE) == 1 + 2


def test_role_overrides_win_over_topology_even_with_unknown_runner() -> None:
    row = disagg(role(9, 8, "PREFILL_NODES=2"), role(9, 8, "DECODE_NODES=1"), runner="zz-unknown")
    assert node_count(row, HARDWARE) == 3


def test_overrides_must_agree_and_be_positive() -> None:
    row = disagg(role(1, 8, "PREFILL_NODES=2"), role(1, 8, "PREFILL_NODES=3", "DECODE_NODES=1"))
    with pytest.raises(NodeCountError, match="PREFILL_NODES is set to different values"):
        node_count(row, HARDWARE)
    row = disagg(role(1, 8, "PREFILL_NODES=0"), role(1, 8))
    with pytest.raises(NodeCountError, match="PREFILL_NODES=0 is not a positive integer"):
        node_count(row, HARDWARE)


def test_heterogeneous_roles_use_their_own_hardware() -> None:
    row = disagg(role(5, 4, hardware="gb200"), role(1, 8, hardware="h100"), runner="gb200")
    assert node_count(row, HARDWARE) == 5 + 1


def test_checked_in_recipe_overrides_topology() -> None:
    row = disagg(role(3, 8, KIMI), role(1, 16, KIMI), runner="gb200")
    assert node_count(row, HARDWARE) == 6 + 4  # recipes not checked in: topology
    assert node_count(row, HARDWARE, RECIPES) == 3 + 4  # the recipe's resources win


def test_recipe_missing_from_checkout_falls_through_to_topology() -> None:
    missing = "CONFIG_FILE=recipes/vllm/not-checked-in.yaml"
    row = disagg(role(3, 4, missing), role(1, 16, missing), runner="gb200")
    assert node_count(row, HARDWARE, RECIPES) == 3 + 4


def test_recipe_agg_nodes_and_recipe_errors(tmp_path: Path) -> None:
    (tmp_path / "agg.yaml").write_text("resources:\n  agg_nodes: 4\n  prefill_nodes: 1\n")
    (tmp_path / "bare.yaml").write_text("resources:\n  gpus_per_node: 8\n")
    agg = {"runner": "b300", "multinode": True, "disagg": False}
    row = {**agg, "prefill": role(2, 16, "CONFIG_FILE=recipes/agg.yaml"), "decode": role(0, 16)}
    assert node_count(row, HARDWARE, tmp_path) == 4
    row = {**agg, "prefill": role(2, 16, "CONFIG_FILE=recipes/bare.yaml"), "decode": role(0, 16)}
    with pytest.raises(NodeCountError, match="neither agg_nodes nor prefill_nodes"):
        node_count(row, HARDWARE, tmp_path)
    row = disagg(
        role(1, 8, "CONFIG_FILE=recipes/agg.yaml"), role(1, 8, "CONFIG_FILE=recipes/b.yaml")
    )
    with pytest.raises(NodeCountError, match="CONFIG_FILE differs between roles"):
        node_count(row, HARDWARE, tmp_path)
    row = disagg(role(1, 8, "CONFIG_FILE=recipes/../../etc/passwd"), role(1, 8))
    with pytest.raises(NodeCountError, match="outside the recipe folder"):
        node_count(row, HARDWARE, tmp_path)


def test_gpus_per_node_falls_back_to_an_agreeing_family() -> None:
    assert gpus_per_node("gb200-new", {"cluster:gb200-nv": 4, "gb200": 4}) == 4
    with pytest.raises(NodeCountError, match="family 'gb300' is ambiguous"):
        gpus_per_node("gb300-x", {"gb300": 4, "cluster:gb300-nv": 2})
    with pytest.raises(NodeCountError, match="add 'tpu-v5' to the hardware table"):
        gpus_per_node("tpu-v5", HARDWARE)


def test_unknown_hardware_for_a_topology_role_names_the_role() -> None:
    row = disagg(role(1, 8), role(1, 8), runner="zz-unknown")
    with pytest.raises(NodeCountError, match=r"prefill\.hardware 'zz-unknown'"):
        node_count(row, HARDWARE)


def _mix_rows() -> list[dict[str, str]]:
    with MIX.open() as handle:
        rows = list(csv.DictReader(handle))
    return [r for r in rows if r["node_count_source"].startswith(("topology", "override"))]


def _row_from_csv(r: dict[str, str]) -> dict[str, Any]:
    def split(cell: str) -> tuple[int, int]:
        workers, tp = cell.split("x")
        return int(workers), int(tp)

    pw, pt = split(r["prefill_workers_x_tp"])
    dw, dt = split(r["decode_workers_x_tp"])
    prefill, decode = role(pw, pt), role(dw, dt)
    if r["node_count_source"].startswith("override"):
        prefill["additional-settings"].append(f"PREFILL_NODES={r['prefill_nodes']}")
        decode["additional-settings"].append(f"DECODE_NODES={r['decode_nodes']}")
    return {
        "runner": r["hardware"],
        "multinode": True,
        "disagg": r["disagg"] == "True",
        "prefill": prefill,
        "decode": decode,
    }


def test_reproduces_the_real_job_mix_for_topology_and_override_rows() -> None:
    rows = _mix_rows()
    assert len(rows) == 281  # 228 topology + 53 override rows in the snapshot
    wrong = []
    for r in rows:
        hardware = {r["hardware"]: int(r["gpus_per_node"])}
        got = node_count(_row_from_csv(r), hardware)
        if got != int(r["total_nodes"]):
            wrong.append((r["row_id"], got, r["total_nodes"]))
    assert wrong == []


def test_single_node_row_is_one_and_multinode_row_needs_a_shape() -> None:
    assert node_count({"runner": "h100", "tp": 8}, HARDWARE) == 1
    with pytest.raises(NodeCountError, match="needs num-nodes or prefill/decode roles"):
        node_count({"runner": "h100", "multinode": True}, HARDWARE)


def test_aggregate_topology_counts_the_single_worker() -> None:
    row = {"runner": "gb300", "multinode": True, "disagg": False}
    row |= {"prefill": role(1, 8), "decode": role(0, 8)}
    assert node_count(row, {"gb300": 4}) == 2
