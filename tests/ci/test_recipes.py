"""srt-slurm recipes: both schemas, the migration, and specs whose node count is admission's."""

from __future__ import annotations

import csv
import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmgate.ci.nodecount import node_count
from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec import recipes
from slurmgate.runtime.spec.from_recipe import (
    RecipeRefused,
    RecipeSpec,
    spec_from_data,
    spec_from_recipe,
)

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "tests" / "data" / "inferencex-recipes"
SCHEMA2 = REPO / "tests" / "data" / "inferencex-recipes-schema2"
MIX = REPO / "slurmgate" / "data" / "inferencex-job-mix.csv"
# GPUs per node by GPU family, as the mix's gpus_per_node column says (tests/admission).
FAMILY_GPUS = {"b200": 8, "b300": 8, "h100": 8, "h200": 8, "mi355x": 8, "gb200": 4, "gb300": 4}


def _mix_recipe_rows() -> list[dict[str, str]]:
    with MIX.open() as handle:
        return [r for r in csv.DictReader(handle) if r["node_count_source"].startswith("recipe:")]


ROWS = _mix_recipe_rows()


@functools.cache
def _built(relative: str) -> RecipeSpec | RecipeRefused:
    """Each shipped recipe's spec, built once for every test (or its refusal)."""
    try:
        return spec_from_recipe(RECIPES / relative)
    except RecipeRefused as exc:
        return exc


def _row(r: dict[str, str], recipe: str) -> dict[str, Any]:
    """The matrix row the mix's line came from: both roles name the recipe in CONFIG_FILE."""

    def role(cell: str) -> dict[str, Any]:
        workers, tp = (int(x) for x in cell.split("x"))
        return {"num-worker": workers, "tp": tp, "additional-settings": [f"CONFIG_FILE={recipe}"]}

    return {
        "runner": r["hardware"],
        "multinode": True,
        "disagg": r["disagg"] == "True",
        "prefill": role(r["prefill_workers_x_tp"]),
        "decode": role(r["decode_workers_x_tp"]),
    }


def test_every_recipe_the_mix_references_is_shipped_and_nothing_else() -> None:
    wanted = {r["recipe"].removeprefix("recipes/") for r in ROWS}
    shipped = {str(p.relative_to(RECIPES)) for p in RECIPES.rglob("*.yaml")}
    assert len(ROWS) == 367 and len(wanted) == 227
    assert shipped == wanted


# Every mix row's node count from its recipe, against its spec's: test_srt_slurm_recipes.py
# checks all 648 rows, these recipes' and srt-slurm's.


def test_how_many_mix_recipes_become_specs() -> None:
    # all 227 recipes run as specs: 36 start a Mooncake KV store (with its master and
    # metadata server), 14 have TensorRT-LLM workers over several nodes, each one MPI world
    outcomes: dict[str, int] = {}
    mpi = 0
    for path in sorted(RECIPES.rglob("*.yaml")):
        built = _built(str(path.relative_to(RECIPES)))
        if isinstance(built, RecipeRefused):
            raise AssertionError(f"refused: {built}")
        reason = "spec, mooncake" if built.spec.deployments[0].mooncake else "spec"
        mpi += any(d.mpi_worlds() for d in layout.plan(built.spec).deployments)
        outcomes[reason] = outcomes.get(reason, 0) + 1
    assert outcomes == {"spec": 191, "spec, mooncake": 36}
    assert mpi == 14


def _schema2_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "recipes_schema2", REPO / "scripts" / "recipes-schema2.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _schema2_script()


@pytest.mark.parametrize("relative", SCRIPT.SUBSET)
def test_schema2_form_reads_as_its_schema1_recipe_and_gives_the_same_spec(relative: str) -> None:
    v1 = recipes.load(RECIPES / relative)
    v2_path = SCHEMA2 / relative
    assert v2_path.read_text() == SCRIPT.schema2_text(relative), "run scripts/recipes-schema2.py"
    v2 = recipes.load(v2_path)
    assert (recipes.schema(v2) == 2 and "roles" in v2 and "resources" not in v2) or (
        not {k for k in v2.get("resources", {}) if k.endswith(("_nodes", "_workers"))}
    )
    assert recipes.expanded(v2) == v1
    one, two = spec_from_data(v1, source=relative), spec_from_data(v2, source=relative)
    assert one.spec == two.spec and one.reported == two.reported
    assert (one.schema, two.schema) == (1, 2)
    assert recipes.role_nodes(v2) == recipes.role_nodes(v1)


def test_node_count_reads_a_schema2_recipe() -> None:
    relative = SCRIPT.SUBSET[2]  # 6 DEP8 prefill workers on 12 GB300 nodes, a DEP16 decode on 4
    row = _row(
        {
            "hardware": "cluster:gb300-nv",
            "disagg": "True",
            "prefill_workers_x_tp": "12x8",
            "decode_workers_x_tp": "4x16",
        },
        f"recipes/{relative}",
    )
    assert node_count(row, FAMILY_GPUS, SCHEMA2) == node_count(row, FAMILY_GPUS, RECIPES) == 16


def test_roles_expand_as_srt_slurms_own_test_says() -> None:
    # srt-slurm's tests/test_roles.py: a roles: recipe expands to these schema-1 fields
    v2 = {
        "schema": 2,
        "name": "roles-test",
        "engine": "sglang",
        "resources": {"gpu_type": "h100", "gpus_per_node": 8},
        "roles": {
            "prefill": {
                "nodes": 2,
                "workers": 6,
                "gpus": 2,
                "env": {"A": "1"},
                "args": {"tensor-parallel-size": 2},
            },
            "decode": {
                "nodes": "colocate",
                "workers": 2,
                "gpus": 2,
                "args": {"tensor-parallel-size": 2},
            },
            "agg": {"extra_args": ["--x"]},
        },
    }
    v1 = recipes.expanded(v2)
    assert v1["resources"] == {
        "gpu_type": "h100",
        "gpus_per_node": 8,
        "prefill_nodes": 2,
        "prefill_workers": 6,
        "gpus_per_prefill": 2,
        "decode_nodes": 0,
        "decode_workers": 2,
        "gpus_per_decode": 2,
    }
    assert v1["backend"] == {
        "type": "sglang",
        "prefill_environment": {"A": "1"},
        "sglang_config": {
            "prefill": {"tensor-parallel-size": 2},
            "decode": {"tensor-parallel-size": 2},
        },
        "aggregated_extra_args": ["--x"],
    }
    back = recipes.to_schema2(v1)
    assert back["roles"] == v2["roles"] and back["engine"] == "sglang"


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"schema": 3}, "schema: 3 is not a recipe schema"),
        ({"schema": 2, "roles": {"warmup": {}}}, "roles.warmup: unknown role"),
        ({"schema": 2, "roles": {"prefill": {"gpu": 1}}}, "unknown keys gpu"),
        (
            {"schema": 2, "roles": {"prefill": {"nodes": 0}}},
            "roles.prefill.nodes: 0 is not a node count",
        ),
        (
            {"schema": 2, "roles": {"prefill": {"nodes": 1}}, "resources": {"prefill_workers": 1}},
            "cannot be combined",
        ),
        ({"schema": 2, "engine": "vllm", "backend": {"type": "sglang"}}, "engine.type: disagrees"),
    ],
)
def test_bad_schema2_recipes_name_the_key(data: dict[str, Any], words: str) -> None:
    with pytest.raises(recipes.RecipeError, match=words.replace(".", r"\.")):
        recipes.expanded(data)


def test_hostile_recipe_files_are_refused_in_one_line(tmp_path: Path) -> None:
    cases = {
        "big.yaml": "a: " + "x" * (recipes.MAX_RECIPE_BYTES + 10),
        "list.yaml": "- 1\n- 2\n",
        "bad.yaml": "a: [1,\n",
        "deep.yaml": "a: " + "[" * 40 + "]" * 40,
        "python.yaml": "a: !!python/object/apply:os.system ['true']\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(recipes.RecipeError) as caught:
            recipes.load(tmp_path / name)
        assert "\n" not in str(caught.value) and " — " in str(caught.value), name


def test_refused_and_reported_keys_are_named(tmp_path: Path) -> None:
    base = yaml.safe_load((RECIPES / SCRIPT.SUBSET[0]).read_text())
    store = {"device_names_by_gpu": ["mlx5_0"]}
    with pytest.raises(RecipeRefused, match=r"device_names_by_gpu: cannot be honoured"):
        spec_from_data({**base, "backend": {**base["backend"], "mooncake_kv_store": store}})
    with pytest.raises(RecipeRefused, match="container_mounts: cannot be honoured"):
        spec_from_data({**base, "container_mounts": {"/a": "/b"}})
    with pytest.raises(RecipeRefused, match="bogus_key: unknown recipe keys"):
        spec_from_data({**base, "bogus_key": 1})
    with pytest.raises(RecipeRefused, match=r"resources\.decode_nodes: 0"):
        spec_from_data({**base, "resources": {**base["resources"], "decode_nodes": 0}})
    built = spec_from_data(base, model="/shared/dsv4")
    keys = {r.key for r in built.reported}
    assert {"model.container", "benchmark", "dynamo", "frontend.enable_multiple_frontends"} <= keys
    assert built.spec.deployments[0].command[4] == "/shared/dsv4"
    assert "# reported: model.container" in built.yaml("x.yaml")


def test_srt_slurms_other_backend_keys_are_reported_never_dropped() -> None:
    """srt-slurm's TensorRT-LLM backend keys (and any other the converter does not read) come
    back in the report with what the run does instead; none vanishes."""
    base = yaml.safe_load((RECIPES / SCRIPT.SUBSET[0]).read_text())
    extra = {
        "publish_events_and_metrics": True,
        "sequential_node_start": 2,
        "numa_memory_bind": True,
        "some_future_key": "x",
    }
    built = spec_from_data({**base, "backend": {**base["backend"], **extra}}, model="/m")
    reported = {r.key: r.how for r in built.reported}
    for key in extra:
        assert f"backend.{key}" in reported, reported
    assert "readiness-gated batches" in reported["backend.sequential_node_start"]
    assert "numactl" in reported["backend.numa_memory_bind"]
    assert reported["backend.some_future_key"] == "not used"
    # what the converter reads is not reported as unused
    assert not {"backend.type", "backend.sglang_config"} & reported.keys()


def test_configs_paths_are_reported_and_go_to_preflight() -> None:
    """srt-slurm's recipes name paths in the configs directory it mounts at /configs (caches
    of DeepGEMM and FlashInfer, DeepEP's config): reported, and checked on every node."""
    from slurmgate.runtime.run.workers import _command_model_paths

    base = yaml.safe_load((RECIPES / SCRIPT.SUBSET[0]).read_text())
    env = {"SGLANG_DG_CACHE_DIR": "/configs/deepgemm-cache"}
    backend = {**base["backend"], "prefill_environment": env, "decode_environment": env}
    built = spec_from_data({**base, "backend": backend}, model="/m")
    reported = {r.key: r.how for r in built.reported}
    assert reported["/configs paths"].startswith("/configs/deepgemm-cache: srt-slurm mounts")
    (deployment,) = built.spec.deployments
    assert deployment.config_paths == ["/configs/deepgemm-cache"]
    assert "/configs/deepgemm-cache" in _command_model_paths(deployment)


HICACHE = "sglang/qwen3.5/gb200-fp4/agentic/agg-gb200-tp2ep2-mtp-hicache.yaml"


def _schema2_with_frontend(kind: str, workers: int = 1) -> dict[str, Any]:
    v2 = recipes.load(SCHEMA2 / HICACHE)  # one aggregated SGLang worker behind sglang-router
    v2["frontend"]["type"] = kind
    v2["roles"]["agg"]["workers"] = workers
    v2["roles"]["agg"]["nodes"] = 1  # 2 GPUs each: two fit one 4-GPU node
    return v2


def test_srt_slurm_2_frontend_names_mean_what_2_means() -> None:
    # 2.x: `sglang-router` is the router (1.x's `sglang`); both forms give one spec
    v1 = spec_from_recipe(RECIPES / HICACHE)
    router = spec_from_data(_schema2_with_frontend("sglang-router"), source=HICACHE)
    assert router.spec == v1.spec
    (deployment,) = router.spec.deployments
    assert deployment.frontend is not None and deployment.frontend.type == "sglang-router"
    # 2.x: `sglang` is one router-free aggregated worker, the engine's own server
    direct = spec_from_data(_schema2_with_frontend("sglang"), source=HICACHE).spec
    (deployment,) = direct.deployments
    assert deployment.engine == "sglang" and deployment.frontend is None
    assert deployment.command[:3] == ["python3", "-m", "sglang.launch_server"]
    # which serves one worker only, as 2.x's does
    with pytest.raises(RecipeRefused, match=r"frontend.type: sglang \(schema 2\) with several"):
        spec_from_data(_schema2_with_frontend("sglang", workers=2), source=HICACHE)
    # migrating a 1.x recipe names its router as 2.x does, and reads back as 1.x's
    migrated = recipes.to_schema2(recipes.load(RECIPES / HICACHE))
    assert migrated["frontend"]["type"] == "sglang-router"
    assert recipes.expanded(migrated)["frontend"]["type"] == "sglang"


def test_a_schema2_vllm_router_frontend_fronts_vllm_workers() -> None:
    v2 = {
        "schema": 2,
        "name": "vllm-router-agg",
        "engine": "vllm",
        "model": {"path": "m"},
        "resources": {"gpu_type": "b200", "gpus_per_node": 8},
        "roles": {
            "agg": {"nodes": 2, "workers": 2, "gpus": 8, "args": {"tensor-parallel-size": 8}}
        },
        "frontend": {"type": "vllm-router"},
    }
    (deployment,) = spec_from_data(v2, source="vllm-router.yaml").spec.deployments
    assert deployment.engine == "vllm"
    assert deployment.frontend is not None and deployment.frontend.type == "vllm-router"
    # schema 1 has no vllm-router: srt-slurm 1.x would not run it
    v1 = recipes.expanded(v2)
    assert v1["frontend"]["type"] == "vllm-router"
