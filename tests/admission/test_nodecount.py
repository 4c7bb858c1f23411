"""Node count of a deployment matrix row: the seed's fixtures (docs/seed.md), the real job mix."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from slurmgate.ci.nodecount import (
    NodeCountError,
    UnknownGpusPerNode,
    gpus_per_node,
    node_count,
)

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
    row = disagg(role(1, 8, "PREFILL_NODES=2", "PREFILL_NODES=3"), role(1, 8, "DECODE_NODES=1"))
    with pytest.raises(NodeCountError, match="sets PREFILL_NODES to different values"):
        node_count(row, HARDWARE)
    # InferenceX reads a role's count only in its own settings: elsewhere it is refused
    row = disagg(role(1, 8, "PREFILL_NODES=2"), role(1, 8, "PREFILL_NODES=3", "DECODE_NODES=1"))
    with pytest.raises(NodeCountError, match="reads only in prefill's settings"):
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


def test_num_nodes_wins_over_a_checked_in_recipe_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "agg.yaml").write_text("resources:\n  agg_nodes: 4\n")
    settings = ("CONFIG_FILE=recipes/agg.yaml", "PREFILL_NODES=3")
    row = {"runner": "b300", "multinode": True, "disagg": False, "num-nodes": 2}
    row |= {"prefill": role(2, 16, *settings), "decode": role(0, 16)}
    assert node_count(row, HARDWARE, tmp_path) == 2  # not the recipe's 4, nor the override's 3
    del row["num-nodes"]
    assert node_count(row, HARDWARE, tmp_path) == 4  # the same row without it: the recipe


def test_recipe_wins_over_role_overrides() -> None:
    row = disagg(role(3, 8, KIMI, "PREFILL_NODES=1"), role(1, 16, KIMI, "DECODE_NODES=1"))
    assert node_count(row, HARDWARE, RECIPES) == 3 + 4  # the recipe's prefill + decode nodes
    assert node_count(row, HARDWARE) == 1 + 1  # recipe not checked in: the overrides


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
    with pytest.raises(UnknownGpusPerNode, match=r"prefill\.hardware 'zz-unknown'"):
        node_count(row, HARDWARE)


@pytest.mark.parametrize(
    ("runner", "hardware"),
    [
        ("zz-unknown", HARDWARE),  # no record of the label or its family
        ("gb300-x", {"gb300": 4, "cluster:gb300-nv": 2}),  # the family disagrees
        (None, HARDWARE),  # nothing names the hardware
    ],
)
def test_missing_gpus_per_node_is_told_apart_from_a_bad_row(
    runner: str | None, hardware: dict[str, int]
) -> None:
    # `slurmgate labels` falls back for this kind (a historical row), and only for this kind
    row = disagg(role(1, 8), role(1, 8, "DECODE_NODES=1"), runner=runner or "")
    if runner is None:
        del row["runner"]
    with pytest.raises(UnknownGpusPerNode):
        node_count(row, hardware)


@pytest.mark.parametrize(
    ("prefill", "decode", "field"),
    [
        (role(1, 8), {**role(1, 8), "tp": "two"}, r"decode\.tp"),
        (role(1, 8), role(1, 8, "DECODE_NODES=0"), "DECODE_NODES=0"),
        (role(1, 8, "CONFIG_FILE=recipes/a.yaml"), role(1, 8, "CONFIG_FILE=recipes/b"), "CONFIG"),
    ],
)
def test_a_bad_claim_wins_over_unknown_hardware(
    prefill: dict[str, Any], decode: dict[str, Any], field: str
) -> None:
    # the prefill role's hardware is unknown too, and it is looked at first
    with pytest.raises(NodeCountError, match=field) as caught:
        node_count(disagg(prefill, decode, runner="zz-unknown"), HARDWARE)
    assert not isinstance(caught.value, UnknownGpusPerNode)


# GPUs per node by GPU family, as the seed states it: 8 everywhere except GB200/GB300 with 4.
# The mix names runners by many labels (`b200-multinode`, `cluster:gb300-nv`, `mi355x-disagg`);
# every one of them resolves through the family fallback, as runners.yaml `hardware:` does.
FAMILY_GPUS = {"b200": 8, "b300": 8, "h100": 8, "h200": 8, "mi355x": 8, "gb200": 4, "gb300": 4}


def _mix_rows() -> list[dict[str, str]]:
    with MIX.open() as handle:
        rows = list(csv.DictReader(handle))
    return [r for r in rows if r["node_count_source"].startswith(("topology", "override"))]


MIX_ROWS = _mix_rows()


def _row_from_csv(r: dict[str, str], overrides: bool = True) -> dict[str, Any]:
    """The matrix row the mix's line came from, as far as the CSV records it.

    The CSV keeps each role's workers x tp, no pp or pcp-size (1 by default). An override row
    gets its recorded per-role counts as PREFILL_NODES / DECODE_NODES: the CSV does not say
    which role carried an override, and in all but three rows topology gives the same count.
    """

    def split(cell: str) -> tuple[int, int]:
        workers, tp = cell.split("x")
        return int(workers), int(tp)

    pw, pt = split(r["prefill_workers_x_tp"])
    dw, dt = split(r["decode_workers_x_tp"])
    prefill, decode = role(pw, pt), role(dw, dt)
    if overrides and r["node_count_source"].startswith("override"):
        prefill["additional-settings"].append(f"PREFILL_NODES={r['prefill_nodes']}")
        decode["additional-settings"].append(f"DECODE_NODES={r['decode_nodes']}")
    return {
        "runner": r["hardware"],
        "multinode": True,
        "disagg": r["disagg"] == "True",
        "prefill": prefill,
        "decode": decode,
    }


def test_the_mix_has_the_seeds_topology_and_override_rows() -> None:
    sources = [r["node_count_source"].split("(")[0] for r in MIX_ROWS]
    assert (sources.count("topology"), sources.count("override")) == (228, 53)
    # the family table says what the mix's own gpus_per_node column says, row by row
    assert all(
        gpus_per_node(r["hardware"], FAMILY_GPUS) == int(r["gpus_per_node"]) for r in MIX_ROWS
    )


@pytest.mark.parametrize("r", MIX_ROWS, ids=[r["row_id"] for r in MIX_ROWS])
def test_rebuilt_mix_row_has_the_mix_node_count(r: dict[str, str]) -> None:
    assert node_count(_row_from_csv(r), FAMILY_GPUS) == int(r["total_nodes"])


def test_override_rows_where_the_override_decides_the_count() -> None:
    # Three GB200 llm-d rows ask for more nodes than their GPUs fill (2+2 for 1x1/1x1, 2+2 for
    # 1x1/1x8, 6+2 for 3x1/1x1): only the override precedence gives the mix's count there.
    differ = [
        r["row_id"]
        for r in MIX_ROWS
        if r["node_count_source"].startswith("override")
        and node_count(_row_from_csv(r, overrides=False), FAMILY_GPUS) != int(r["total_nodes"])
    ]
    assert len(differ) == 3 and all(row_id.startswith("dsv4-fp4-gb200-llmd") for row_id in differ)


def test_single_node_row_is_one_and_multinode_row_needs_a_shape() -> None:
    assert node_count({"runner": "h100", "tp": 8}, HARDWARE) == 1
    with pytest.raises(NodeCountError, match="needs num-nodes or prefill/decode roles"):
        node_count({"runner": "h100", "multinode": True}, HARDWARE)


def test_aggregate_topology_counts_the_single_worker() -> None:
    row = {"runner": "gb300", "multinode": True, "disagg": False}
    row |= {"prefill": role(1, 8), "decode": role(0, 8)}
    assert node_count(row, {"gb300": 4}) == 2


@pytest.mark.parametrize("given", ["prefill_nodes: 3", "decode_nodes: 2"])
def test_a_recipe_giving_one_side_only_is_refused_as_inferencex_refuses_it(
    tmp_path: Path, given: str
) -> None:
    # InferenceX's generator reads prefill_nodes + decode_nodes only when both are there and
    # refuses the recipe otherwise; counting the missing side as 0 would under-count the job
    (tmp_path / "half.yaml").write_text(f"resources:\n  gpus_per_node: 4\n  {given}\n")
    row = disagg(role(3, 4, "CONFIG_FILE=recipes/half.yaml"), role(1, 16), runner="gb200")
    missing = "decode_nodes" if given.startswith("prefill") else "prefill_nodes"
    with pytest.raises(NodeCountError, match=f"but not {missing}; add resources.{missing}"):
        node_count(row, HARDWARE, tmp_path)
    # with the other side written out (0 included), the recipe decides
    (tmp_path / "whole.yaml").write_text(f"resources:\n  {given}\n  {missing}: 0\n")
    row = disagg(role(3, 4, "CONFIG_FILE=recipes/whole.yaml"), role(1, 16), runner="gb200")
    assert node_count(row, HARDWARE, tmp_path) == int(given.split(": ")[1])


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_hardware_on_one_role_only_is_refused(where: str) -> None:
    # InferenceX's matrix validation: both roles name their hardware, or neither does
    roles = {"prefill": role(5, 4), "decode": role(1, 8)}
    roles[where]["hardware"] = "h100"
    row = disagg(roles["prefill"], roles["decode"], runner="gb200")
    with pytest.raises(NodeCountError, match=f"{where}.hardware is set but"):
        node_count(row, HARDWARE)
    # even where the node count would not read it (an override or a recipe decides)
    row["prefill"]["additional-settings"] = ["PREFILL_NODES=2"]
    row["decode"]["additional-settings"] = ["DECODE_NODES=1"]
    with pytest.raises(NodeCountError, match="for both prefill and decode, or neither"):
        node_count(row, HARDWARE)
