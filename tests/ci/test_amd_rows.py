"""The job mix's AMD rows as specs: InferenceX's scripts translated, node counts as admission's."""

from __future__ import annotations

from typing import Any

import pytest

from slurmgate.ci.nodecount import node_count
from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec import from_row
from slurmgate.runtime.spec.from_row import (
    IB_DEVICES,
    ROUTER_AGENTIC,
    ROUTER_DI,
    RowError,
    RowRefused,
    RowSpec,
    matrix_row,
    matrix_rows,
    mix_rows,
    spec_from_row,
)

FAMILY_GPUS = {"mi355x": 8}
AMD = [r for r in mix_rows().values() if r["source_file"] == from_row.SOURCE]


def _built(row_id: str) -> RowSpec | RowRefused:
    try:
        return spec_from_row(row_id)
    except RowRefused as exc:
        return exc


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_generators_rows_are_the_mixs_rows() -> None:
    """Enumerated as InferenceX's sweep generator does, each config key gives the mix's rows,
    with their concurrencies and role shapes."""
    assert len(AMD) == 48
    for r in AMD:
        row = matrix_row(r["row_id"])
        assert " ".join(str(c) for c in row["conc"]) == r["conc"]
        for role in ("prefill", "decode"):
            shape = f"{row[role]['num-worker']}x{row[role]['tp']}"
            assert shape == r[f"{role}_workers_x_tp"], r["row_id"]
        assert row["scenario"] == r["scenario"] and row["runner"] == r["hardware"]
    keys = {r["config_key"] for r in AMD}
    assert sum(len(matrix_rows(k)) for k in keys) == 48


@pytest.mark.parametrize("r", AMD, ids=[r["row_id"] for r in AMD])
def test_an_amd_rows_spec_needs_the_nodes_admission_counts(r: dict[str, str]) -> None:
    admitted = node_count(matrix_row(r["row_id"]), FAMILY_GPUS)
    assert admitted == int(r["total_nodes"])
    built = _built(r["row_id"])
    if r["framework"] == "atom-disagg":
        assert isinstance(built, RowRefused)
        assert "framework atom-disagg: cannot be represented" in str(built)
        return
    assert isinstance(built, RowSpec), built
    spec = built.spec
    assert spec.total_nodes == layout.plan(spec).total_nodes == admitted
    (d,) = spec.deployments
    assert d.roles is not None and d.kv_transfer == "mori"
    plan = layout.plan(spec).deployments[0]
    for role in ("prefill", "decode"):
        nodes = {n.node for n in plan.nodes for lane in n.lanes if lane.role == role}
        assert len(nodes) == int(r[f"{role}_nodes"]), role
    assert d.frontend is not None and d.frontend.type == "sglang-router"
    assert d.env["NCCL_IB_HCA"] == IB_DEVICES and d.env["MORI_RDMA_TC"] == "104"
    for _, role_spec in d.roles.items():
        assert role_spec.args[:2] == ["--disaggregation-ib-device", IB_DEVICES]


def test_46_rows_become_specs_and_the_2_atom_rows_are_refused() -> None:
    outcomes = [isinstance(_built(r["row_id"]), RowSpec) for r in AMD]
    assert (outcomes.count(True), outcomes.count(False)) == (46, 2)


def test_a_dep8_row_takes_the_scripts_dp_ep_overrides() -> None:
    # dsr1-fp8 "top of curve": 2 DEP8 prefill workers, 1 DEP8 decode, conc 1024 and 2048
    (d,) = spec_from_row("dsr1-fp8-mi355x-sglang-disagg#0").spec.deployments
    assert d.roles is not None and d.roles.prefill is not None and d.roles.decode is not None
    p, dec = d.roles.prefill, d.roles.decode
    assert (p.workers, p.tensor_parallel, p.data_parallel, p.expert_parallel) == (2, 8, 8, 8)
    assert p.dp_attention and dec.dp_attention
    # models.yaml DeepSeek-R1-0528: EP flags, DP flags; the prefill's chunk is 8192 × TP
    assert _value(p.args, "--moe-a2a-backend") == "mori" and "--enable-dp-lm-head" in p.args
    assert _value(p.args, "--chunked-prefill-size") == "65536"
    assert _value(p.args, "--cuda-graph-bs") == "1" and "--disable-radix-cache" in p.args
    # with DP and EP both roles run the row's highest concurrency
    assert _value(p.args, "--max-running-requests") == "2048"
    assert _value(dec.args, "--max-running-requests") == "2048"
    i = dec.args.index("--cuda-graph-bs")
    assert dec.args[i + 1 : i + 161] == [str(n) for n in range(1, 161)]
    assert "--enable-dp-attention" not in p.args + dec.args  # the launcher renders it
    # decode dispatch tokens: 2048 / 8 ranks; the switch threshold twice that
    assert dec.env["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] == "256"
    assert d.env["SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD"] == "512"
    assert p.env["SGLANG_MORI_MOE_MAX_INPUT_TOKENS"] == "32768"
    assert d.frontend is not None and d.frontend.args == ROUTER_DI


def test_a_partial_node_prefill_and_mtp_on_both_roles() -> None:
    # Qwen3.5 FP8: a TP4 prefill on a node of its own, no EP or DP flags
    (d,) = spec_from_row("qwen3.5-fp8-mi355x-sglang-disagg#0").spec.deployments
    assert d.roles is not None and d.roles.prefill is not None
    assert (d.roles.prefill.tensor_parallel, d.roles.prefill.workers_per_node) == (4, 1)
    assert "--moe-a2a-backend" not in d.roles.prefill.args
    assert _value(d.roles.prefill.args, "--moe-dense-tp-size") == "1"
    # DeepSeek-R1 MXFP4 with MTP depth 3: the NextN draft on prefill and decode alike
    (d,) = spec_from_row("dsr1-fp4-mi355x-sglang-disagg-mtp#0").spec.deployments
    assert d.roles is not None
    for _, role in d.roles.items():
        assert _value(role.args, "--speculative-draft-model-path") == "SGLang/DeepSeek-R1-NextN"
        assert _value(role.args, "--speculative-num-steps") == "3"
        assert _value(role.args, "--speculative-num-draft-tokens") == "4"
    assert d.roles.decode is not None  # decode dispatch tokens: 512 × (3 + 1)
    assert d.roles.decode.env["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] == "2048"


def test_two_batch_overlap_turns_sdma_on_for_the_prefill() -> None:
    (d,) = spec_from_row("dsr1-fp4-mi355x-sglang-disagg#5").spec.deployments
    assert d.roles is not None and d.roles.prefill is not None
    p = d.roles.prefill
    assert "--enable-two-batch-overlap" in p.args and p.env["MORI_ENABLE_SDMA"] == "true"
    assert _value(p.args, "--context-length") == "9217"
    assert _value(p.args, "--max-total-tokens") == "131072"


def test_an_agentic_row_gets_hicache_the_golden_acceptance_and_the_agentic_router() -> None:
    built = spec_from_row("dsv4-fp4-mi355x-sglang-disagg-agentic-hicache-mtp#9")
    (d,) = built.spec.deployments
    assert d.roles is not None and d.roles.prefill is not None and d.roles.decode is not None
    p, dec = d.roles.prefill, d.roles.decode
    assert "--enable-hierarchical-cache" in p.args and _value(p.args, "--hicache-ratio") == "3"
    assert "--disable-radix-cache" not in p.args and "--enable-hierarchical-cache" not in dec.args
    assert p.args[-1] == "best_effort" and dec.args[-2:] == ["--page-size", "256"]
    assert dec.env["SGLANG_SIMULATE_ACC_LEN"] == "2.49"  # DeepSeek-V4, MTP depth 3
    assert d.env["MORI_IO_QP_MAX_SEND_WR"] == "32767"  # env.sh's DeepSeek-V4 pin wins
    assert d.env["SGLANG_HACK_FLASHMLA_BACKEND"] == "unified_kv_triton"
    assert d.frontend is not None and d.frontend.args == ROUTER_AGENTIC
    assert d.startup_timeout_s == 3000.0
    keys = {r.key for r in built.reported}
    assert {"benchmark", "image", "CLIENT_IMAGE", "setup_deps.sh"} <= keys
    assert "# reported: benchmark: agentic trace replay" in built.yaml()


def test_the_model_path_and_ib_devices_are_the_sites() -> None:
    built = spec_from_row("dsv4-fp4-mi355x-sglang-disagg#1", model="/m/v4", ib_devices="mlx5_0")
    (d,) = built.spec.deployments
    assert d.command[4] == "/m/v4" and d.env["NCCL_IB_HCA"] == "mlx5_0"
    assert d.roles is not None
    assert all(_value(r.args, "--disaggregation-ib-device") == "mlx5_0" for _, r in d.roles.items())


@pytest.mark.parametrize(
    ("row_id", "kwargs", "error", "words"),
    [
        ("nope#0", {}, RowError, "no such row_id"),
        ("dsr1-fp4-b200-dynamo-trt#0", {}, RowRefused, "build it with slurmgate spec from-recipe"),
        ("dsr1-fp8-mi355x-sglang-disagg#0", {"ib_devices": "a b"}, RowError, "--ib-devices"),
    ],
)
def test_bad_rows_and_options_are_named(
    row_id: str, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        spec_from_row(row_id, **kwargs)


def test_a_row_whose_node_count_disagrees_with_its_scripts_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = dict(matrix_row("dsr1-fp8-mi355x-sglang-disagg#0"))
    row["prefill"] = {**row["prefill"], "additional-settings": ["PREFILL_NODES=3"]}
    monkeypatch.setattr(from_row, "matrix_row", lambda row_id: row)
    # submit.sh's TP would be 3 × 8 / 2 = 12: two workers of two nodes each, not three nodes
    with pytest.raises(RowRefused, match=r"PREFILL_NODES=3, but .* 2 worker\(s\) of TP 12 on 4"):
        spec_from_row("dsr1-fp8-mi355x-sglang-disagg#0")
