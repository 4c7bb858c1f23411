"""`--local`: every shipped recipe on the bundled cluster, its shape kept, stand-ins named."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from slurmgate.errors import InputError
from slurmgate.runtime.engines import layout, service_lanes, vllm_cpu
from slurmgate.runtime.spec import recipes
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.deployment import DeploymentSpec
from slurmgate.runtime.spec.from_recipe import RecipeRefused, RecipeSpec, spec_from_recipe
from slurmgate.runtime.spec.local_recipe import (
    LOCAL_GPUS_PER_NODE,
    LOCAL_MAX_WORKERS,
    LOCAL_NODES,
    localize,
)

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "tests" / "data" / "inferencex-recipes"
SHIPPED = sorted(p.relative_to(RECIPES).as_posix() for p in RECIPES.rglob("*.yaml"))
# any executable stands for the Dynamo venv's python: the mapping only names it
PYTHON = sys.executable


@functools.cache
def _production(relative: str) -> RecipeSpec | RecipeRefused:
    try:
        return spec_from_recipe(RECIPES / relative)
    except RecipeRefused as exc:
        return exc


def _local(relative: str) -> tuple[RecipeSpec, RecipeSpec] | None:
    built = _production(relative)
    if isinstance(built, RecipeRefused):
        return None
    return built, localize(built, dynamo_python=PYTHON, source=relative)


@pytest.mark.parametrize("relative", SHIPPED)
def test_every_shipped_recipe_maps_onto_the_bundled_cluster_or_is_refused(relative: str) -> None:
    pair = _local(relative)
    if pair is None:  # refused in production: --local builds on production, so it says the same
        with pytest.raises(RecipeRefused):
            spec_from_recipe(RECIPES / relative)
        return
    built, local = pair
    prod, spec = built.spec.deployments[0], local.spec.deployments[0]
    assert local.spec.total_nodes <= LOCAL_NODES
    assert local.spec.gpus_per_node == LOCAL_GPUS_PER_NODE
    assert prod.roles is not None and spec.roles is not None
    # the same roles, at least one worker each, in proportion, each worker on one node
    prod_workers = {name: role.workers for name, role in prod.roles.items()}
    workers = {name: role.workers for name, role in spec.roles.items()}
    assert set(workers) == set(prod_workers) and min(workers.values()) >= 1
    assert sum(workers.values()) <= LOCAL_MAX_WORKERS
    if set(workers) == {"prefill", "decode"} and prod_workers["prefill"] != prod_workers["decode"]:
        more = max(prod_workers, key=lambda n: prod_workers[n])
        assert workers[more] >= min(workers.values()), (prod_workers, workers)
    for name, _ in spec.roles.items():
        assert spec.worker_gpus(name) == min(prod.worker_gpus(name), LOCAL_GPUS_PER_NODE)
    # the frontend kind stays, and decides the stand-in; plain vLLM (vllm serve, no router)
    # gets Dynamo's, whose mocker serves no HTTP itself
    kind = prod.frontend.type if prod.frontend else None
    plain_vllm = prod.engine == "vllm" and kind is None
    assert (spec.frontend.type if spec.frontend else None) == ("dynamo" if plain_vllm else kind)
    lines = [r.line() for r in local.reported]
    if kind == "dynamo" or plain_vllm:
        assert spec.stand_in == "dynamo-mocker"
        assert spec.command == [PYTHON, "-m", "dynamo.mocker"]
        assert spec.frontend is not None and spec.frontend.argv_head[1:] == [
            "-m",
            "dynamo.frontend",
        ]
        engine = "vllm serve" if plain_vllm else prod.engine
        assert any(
            line.startswith(f"engine: --local: {engine} → Dynamo's mocker") for line in lines
        )
    else:
        assert spec.engine == "custom" and spec.stand_in is None
        assert spec.command[:3] == ["python", "-m", "slurmgate.testbed.stub_server"]
        assert any(
            line.startswith(f"engine: --local: {prod.engine} → the stub server") for line in lines
        )
    assert not spec.config_paths and not spec.env.keys() - {"SLURMGATE_STUB_TOKENS_PER_SECOND"}
    # every lane renders: the stand-in's argv, none of the engine's flags, its ports free
    plan = layout.plan(local.spec)
    assert layout.port_problems(local.spec) == []
    lanes = [lane for n in plan.deployments[0].nodes for lane in n.lanes]
    assert len(lanes) == sum(workers.values())
    for lane in lanes:
        argv = layout.lane_argv(spec, lane, "h0", bind_host="10.0.0.1", model_dir="/m")
        assert argv[:3] == spec.command[:3] and "--mem-fraction-static" not in argv, argv
        assert not any(
            k.startswith(("SGLANG", "VLLM", "NCCL", "TRTLLM"))
            for k in layout.lane_env(spec, lane, "10.0.0.1")
        )
    # the production spec, and so what admission counts, is untouched
    assert built.spec == spec_from_recipe(RECIPES / relative).spec


def test_workers_scale_by_one_factor_and_sizes_shrink_to_a_node() -> None:
    pair = _local("vllm/deepseek-v4/8k1k/disagg-gb300-7p2d-dep4-dep16.yaml")
    assert pair is not None
    local = pair[1]
    roles = dict(local.spec.deployments[0].roles.items())  # type: ignore[union-attr]
    assert (roles["prefill"].workers, roles["decode"].workers) == (5, 1)
    lines = [r.line() for r in local.reported]
    assert "workers: --local: prefill 7 → 5, decode 2 → 1: scaled by one factor" in "\n".join(lines)
    assert any(
        line.startswith("decode.sizes: --local: a worker of DP16×EP16 (16 GPUs) → TP8 (8 GPUs)")
        for line in lines
    ), lines


def test_a_recipe_that_fits_keeps_its_workers() -> None:
    pair = _local("sglang/deepseek-v4/8k1k/disagg-b300-2p1d-dep4-dep8.yaml")
    assert pair is not None
    roles = dict(pair[1].spec.deployments[0].roles.items())  # type: ignore[union-attr]
    assert (roles["prefill"].workers, roles["decode"].workers) == (2, 1)
    assert not any(r.key == "workers" for r in pair[1].reported)


def test_trtllm_serve_is_refused_by_name(tmp_path: Path) -> None:
    data = recipes.load(
        RECIPES / "trtllm/qwen3.5/gb300-fp4/disagg/8k1k/stp/ctx3dep2_gen1dep4_mtp0_c1536.yaml"
    )
    data.setdefault("frontend", {})["type"] = "trtllm_serve"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    built = spec_from_recipe(path)
    with pytest.raises(RecipeRefused, match=r"trtllm_serve: --local cannot stand in"):
        localize(built, dynamo_python=PYTHON)


def test_a_missing_dynamo_python_names_the_option_and_the_fix(tmp_path: Path) -> None:
    built = _production("sglang/qwen3.5/gb200-fp8/8k1k/1p1d-tp4-tp4.yaml")
    assert isinstance(built, RecipeSpec)
    with pytest.raises(InputError, match=r"--dynamo-python: .* SLURMGATE_DYNAMO_PYTHON"):
        localize(built, dynamo_python=str(tmp_path / "nothing"))
    # a stub recipe needs no Dynamo
    stub = _production("sglang/qwen3.5/gb200-fp4/agentic/agg-gb200-tp4-mtp.yaml")
    assert isinstance(stub, RecipeSpec)
    assert (
        localize(stub, dynamo_python=str(tmp_path / "nothing")).spec.deployments[0].engine
        == "custom"
    )


PLAIN_VLLM = "vllm/kimi-k3/agentic/agg-b200-tp8pp2-agentic.yaml"
DYNAMO_VLLM_AGG = "vllm/deepseek-v4/8k1k/agg-gb200-low-latency-mtp2.yaml"


def _rendered(spec: AllocationSpec, served: str | None = None) -> dict[str, Any]:
    """What a spec's lanes and service lanes run (argv and env), as the runtime renders them
    on loopback nodes, its deployment named `name` (and its command's `served` name too)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    (dep,) = data["deployments"]
    dep["name"] = "name"
    dep["command"] = ["name" if a == served else a for a in dep["command"]]
    renamed = AllocationSpec.from_data(data)
    (dspec,) = renamed.deployments
    plan = layout.plan(renamed)
    hosts = [f"n{i}" for i in range(plan.total_nodes)]
    lay = layout.bind(plan, hosts, dict.fromkeys(hosts, "127.0.0.1"))
    (d,) = lay.plan.deployments
    lanes = [
        (
            lane.process_id,
            layout.lane_argv(dspec, lane, "127.0.0.1", bind_host="127.0.0.1", model_dir="/m"),
            layout.lane_env(dspec, lane, "127.0.0.1"),
        )
        for n in d.nodes
        for lane in n.lanes
    ]
    services = [
        (dataclasses.astuple(s.plan), s.argv, s.env, s.files)
        for s in service_lanes.service_launches(dspec, lay, d)
    ]
    return {
        "lanes": lanes,
        "services": services,
        "service_env": service_lanes.service_env(dspec, lay),
        "expected": layout.expected_workers(dspec, d),
        "env": dspec.env,
    }


def test_plain_vllm_runs_dynamos_mocker_behind_dynamos_frontend_by_default() -> None:
    """Plain `vllm serve` with no router maps onto what a Dynamo vLLM recipe's --local spec
    runs: the mocker serves no HTTP, so Dynamo's frontend (with etcd and NATS) comes too."""
    pair = _local(PLAIN_VLLM)
    assert pair is not None
    built, local = pair
    assert built.spec.deployments[0].engine == "vllm" and built.spec.deployments[0].frontend is None
    spec = local.spec.deployments[0]
    assert (spec.engine, spec.stand_in) == ("dynamo-vllm", "dynamo-mocker")
    assert spec.frontend is not None and spec.frontend.type == "dynamo"
    assert spec.frontend.services == ("etcd", "nats")
    lines = "\n".join(r.line() for r in local.reported)
    assert "engine: --local: vllm serve → Dynamo's mocker" in lines
    assert "the mocker serves no HTTP itself (--vllm-cpu runs one real vLLM-CPU worker" in lines
    assert "frontend: --local: none (vllm serve answers clients itself) → dynamo" in lines
    # the same deployment, lanes and services as a shipped dynamo-vllm agg recipe's --local spec
    dynamo = _local(DYNAMO_VLLM_AGG)
    assert dynamo is not None
    ours, theirs = (
        {**s.spec.deployments[0].model_dump(exclude={"name"})} for s in (local, dynamo[1])
    )
    assert ours == theirs
    assert _rendered(local.spec) == _rendered(dynamo[1].spec)
    (lane,) = _rendered(local.spec)["lanes"]
    assert lane[1] == [
        *(PYTHON, "-m", "dynamo.mocker", "--model-path", "/m", "--model-name", "name"),
        *("--disaggregation-mode", "agg", "--speedup-ratio", "0"),
    ]


def test_vllm_cpu_runs_one_real_worker_as_the_slow_vllm_test_runs_it() -> None:
    """With a vLLM-CPU python, a plain vLLM recipe runs one vLLM worker on CPU, whose argv and
    env are those tests/runtime/test_vllm_cpu_slurm.py runs on the cluster (its port and
    served name aside): that slow test covers this mapping."""
    from tests.runtime.test_vllm_cpu_slurm import MODEL, vllm_spec

    built = _production(PLAIN_VLLM)
    assert isinstance(built, RecipeSpec)
    # it needs no Dynamo
    local = localize(built, dynamo_python="", vllm_python=PYTHON, source=PLAIN_VLLM)
    spec = local.spec.deployments[0]
    assert (spec.engine, spec.stand_in, spec.frontend) == ("vllm", "vllm-cpu", None)
    assert spec.roles is not None
    assert [(n, r.workers, r.tensor_parallel) for n, r in spec.roles.items()] == [("agg", 1, 1)]
    assert local.spec.total_nodes == 1
    assert spec.startup_timeout_s == vllm_cpu.STARTUP_TIMEOUT_S
    lines = "\n".join(r.line() for r in local.reported)
    assert f"engine: --local: vllm serve → vLLM on CPU ({PYTHON} -m {vllm_cpu.MODULE}" in lines
    assert "agg.sizes: --local: a worker of TP8×PP2 (16 GPUs) → TP1 (1 GPU)" in lines
    assert "agg.args/env: --local: the engine's own, dropped" in lines
    slow = vllm_spec(PYTHON)
    ours = _rendered(local.spec, served=spec.name)
    theirs = _rendered(slow, served=MODEL)
    ((_, argv, env),) = ours["lanes"]
    ((_, slow_argv, slow_env),) = theirs["lanes"]
    at = argv.index("--port") + 1
    assert [*argv[:at], "PORT", *argv[at + 1 :]] == [*slow_argv[:at], "PORT", *slow_argv[at + 1 :]]
    assert argv[:5] == [PYTHON, "-m", vllm_cpu.MODULE, "--model", "/m"]
    assert "--enforce-eager" in argv and "--tensor-parallel-size" in argv
    assert env == slow_env and ours["env"] == theirs["env"] == vllm_cpu.ENV
    assert not ours["services"] and not theirs["services"]


@pytest.mark.parametrize(
    "relative",
    [
        "sglang/qwen3.5/gb200-fp8/8k1k/1p1d-tp4-tp4.yaml",  # dynamo-sglang
        "sglang/qwen3.5/gb200-fp4/agentic/agg-gb200-tp4-mtp.yaml",  # sglang-router
        DYNAMO_VLLM_AGG,  # vLLM behind Dynamo's frontend
        "trtllm/qwen3.5/gb300-fp4/disagg/8k1k/stp/ctx3dep2_gen1dep4_mtp0_c1536.yaml",
    ],
)
def test_vllm_cpu_is_refused_by_name_for_a_recipe_that_is_not_plain_vllm(relative: str) -> None:
    built = _production(relative)
    assert isinstance(built, RecipeSpec)
    with pytest.raises(InputError, match=r"^--vllm-cpu: .* not plain vLLM .* without --vllm-cpu"):
        localize(built, dynamo_python=PYTHON, vllm_python=PYTHON, source=relative)


@pytest.mark.parametrize("given", ["", "nothing", "."])
def test_a_missing_vllm_python_names_the_flag_and_the_fix(tmp_path: Path, given: str) -> None:
    built = _production(PLAIN_VLLM)
    assert isinstance(built, RecipeSpec)
    path = str(tmp_path / given) if given else ""
    with pytest.raises(InputError, match=r"^--vllm-python: .*SLURMGATE_VLLM_PYTHON.*\.venv-vllm"):
        localize(built, dynamo_python=PYTHON, vllm_python=path)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_the_cli_flag_prints_the_local_spec_and_node_count_stays_productions(
    tmp_path: Path,
) -> None:
    recipe = RECIPES / "vllm/deepseek-v4/8k1k/disagg-gb300-7p2d-dep4-dep16.yaml"
    done = _cli(
        "spec", "from-recipe", str(recipe), "--local", env={"SLURMGATE_DYNAMO_PYTHON": PYTHON}
    )
    assert done.returncode == 0, done.stderr
    assert "reported: engine: --local: dynamo-vllm → Dynamo's mocker" in done.stderr
    assert "# reported: workers: --local: prefill 7 → 5" in done.stdout
    spec = AllocationSpec.from_data(yaml.safe_load(done.stdout))
    assert spec.total_nodes == LOCAL_NODES and spec.deployments[0].command[0] == PYTHON
    assert recipes.role_nodes(recipes.load(recipe)) == {"prefill": 7, "decode": 8}
    missing = _cli(
        "spec", "from-recipe", str(recipe), "--local", "--dynamo-python", "no/such/python"
    )
    assert missing.returncode == 2 and "--dynamo-python" in missing.stderr
    assert "Traceback" not in missing.stderr
    alone = _cli("allocation", "run", str(tmp_path / "spec.yaml"), "--local")
    assert alone.returncode == 2 and "--local maps a recipe" in alone.stderr


def test_the_cli_flags_run_plain_vllm_on_vllm_cpu_and_refuse_it_elsewhere(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slurmgate.cli.app import app

    def spec_of(result: Result) -> DeploymentSpec:
        assert result.exit_code == 0, result.stderr
        return AllocationSpec.from_data(yaml.safe_load(result.stdout)).deployments[0]

    plain = str(RECIPES / PLAIN_VLLM)
    done = cli.invoke(
        app, ["spec", "from-recipe", plain, "--local", "--vllm-cpu", "--vllm-python", PYTHON]
    )
    assert spec_of(done).stand_in == "vllm-cpu" and spec_of(done).command[0] == PYTHON
    assert "reported: engine: --local: vllm serve → vLLM on CPU" in done.stderr
    # the env form names the venv; only --vllm-cpu asks for it
    monkeypatch.setenv("SLURMGATE_VLLM_PYTHON", PYTHON)
    monkeypatch.setenv("SLURMGATE_DYNAMO_PYTHON", PYTHON)
    done = cli.invoke(app, ["spec", "from-recipe", plain, "--local"])
    assert spec_of(done).stand_in == "dynamo-mocker"
    done = cli.invoke(app, ["spec", "from-recipe", plain, "--local", "--vllm-cpu"])
    assert spec_of(done).stand_in == "vllm-cpu"
    refused = {
        "--vllm-cpu: ": [str(RECIPES / DYNAMO_VLLM_AGG), "--local", "--vllm-cpu"],
        "--vllm-python: ": [plain, "--local", "--vllm-cpu", "--vllm-python", "no/such/python"],
        "--vllm-cpu: a stand-in": [plain, "--vllm-cpu"],
        "add --vllm-cpu": [plain, "--local", "--vllm-python", PYTHON],
    }
    for words, args in refused.items():
        done = cli.invoke(app, ["spec", "from-recipe", *args])
        assert done.exit_code == 2 and words in done.stderr, (args, done.stderr)
    alone = cli.invoke(app, ["allocation", "run", str(tmp_path / "spec.yaml"), "--vllm-cpu"])
    assert alone.exit_code == 2 and "--vllm-cpu maps a plain vLLM recipe" in alone.stderr


SA_BENCH_RECIPE = (
    Path(__file__).resolve().parents[2]
    / "tests/data/srt-slurm-recipes/trtllm/h200/8k1k/stp/c8_ctx1_gen6_tep8_batch16_eplb0_mtp0.yaml"
)


def test_bench_runs_the_recipes_sa_bench_scaled_for_the_stand_ins() -> None:
    built = spec_from_recipe(SA_BENCH_RECIPE)
    local = localize(built, dynamo_python=PYTHON, bench=True)
    (script,) = local.spec.client.command[2:]
    name = local.spec.deployments[0].name
    assert script == (
        'exec python -m slurmgate.cli bench sa-bench "${OPENAI_BASE_URL%/v1}" '
        f'--model {name} --tokenizer "$SLURMGATE_STAND_IN_MODEL_DIR" --isl 64 --osl 16 '
        # the recipe's concurrency 48, capped at 4; its GPU counts name the result files
        "--concurrencies 4 --num-prompts-mult 2 --num-warmup-mult 0 --gpus 56 "
        "--prefill-gpus 8 --decode-gpus 48 --disaggregated"
    )
    assert any(r.key == "client" and "sa-bench, scaled down" in r.how for r in local.reported)
    # without --bench, and for a recipe whose client is no sa-bench, the three chats stay
    plain = localize(built, dynamo_python=PYTHON)
    assert plain.spec.client.command[:2] == ["python", "-c"]


AGENTIC_RECIPE = (
    Path(__file__).resolve().parents[2]
    / "tests/data/inferencex-branch-recipes/benchmarks/multi_node/srt-slurm-recipes/trtllm"
    / "deepseek-v4/agentx-gb300-20260811/dynamo-disagg-gb300-1p4d-dep4-tep8-c4-b1-mtp.yaml"
)


def test_bench_runs_the_recipes_agentic_replay_over_a_stand_in_corpus() -> None:
    built = spec_from_recipe(AGENTIC_RECIPE)
    local = localize(built, dynamo_python=PYTHON, bench=True)
    (script,) = local.spec.client.command[2:]
    name = local.spec.deployments[0].name
    assert script == (
        'exec python -m slurmgate.cli bench aiperf "${OPENAI_BASE_URL%/v1}" '
        f'--model {name} --tokenizer "$SLURMGATE_STAND_IN_MODEL_DIR" '
        # the recipe's concurrency 4; the hub's corpus and the recipe's script are left out
        "--concurrencies 4 --duration 8 --stand-in-traces"
    )
    how = next(r.how for r in local.reported if r.key == "client")
    assert "agentic AIPerf replay, scaled down" in how and "not fetched" in how
