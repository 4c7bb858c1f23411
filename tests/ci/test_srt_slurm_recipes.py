"""The recipes the job mix names beyond InferenceX's checked-in ones: bytes, variants, counts."""

from __future__ import annotations

import copy
import csv
import functools
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from slurmgate import documents
from slurmgate.ci.nodecount import NodeCountError, node_count
from slurmgate.cli.app import app
from slurmgate.documents import parse_yaml
from slurmgate.errors import InputError
from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec import recipes, variants
from slurmgate.runtime.spec.from_recipe import RecipeRefused, RecipeSpec, spec_from_recipe

REPO = Path(__file__).resolve().parents[2]
SRT = REPO / "tests" / "data" / "srt-slurm-recipes"
INFERENCEX = REPO / "tests" / "data" / "inferencex-recipes"
# InferenceX files the generator did not read as recipes, at their InferenceX paths
BRANCH = REPO / "tests" / "data" / "inferencex-branch-recipes"
BRANCH_LLM_D = BRANCH / "benchmarks" / "multi_node" / "llm-d-recipes"


def _load_table_script() -> Any:
    loaded = importlib.util.spec_from_file_location(
        "job_mix_table", REPO / "scripts" / "job-mix-table.py"
    )
    assert loaded and loaded.loader
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


_TABLE = _load_table_script()
MIX = REPO / "slurmgate" / "data" / "inferencex-job-mix.csv"
# GPUs per node by GPU family, as the mix's gpus_per_node column says (tests/admission).
FAMILY_GPUS = {"b200": 8, "b300": 8, "h100": 8, "h200": 8, "mi355x": 8, "gb200": 4, "gb300": 4}
NOT_CHECKED_IN = "recipe-not-checked-in"
VARIANTS = SRT / "b200-fp4" / "8k1k.yaml"  # base, 5 overrides, 2 zip groups of 3


def _mix() -> list[dict[str, str]]:
    with MIX.open() as handle:
        return list(csv.DictReader(handle))


MIX_ROWS = _mix()


def _manifest(folder: Path = SRT) -> dict[str, tuple[str, str]]:
    """SOURCE.md's table: file -> (commit, git blob id); a branch column may come between."""
    text = (folder / "SOURCE.md").read_text()
    return {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(
            r"^\| `([^`]+)` \|(?: `[^`]+` \|)? `([0-9a-f]{8})` \| `([0-9a-f]{40})` \|$",
            text,
            re.M,
        )
    }


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_shipped_recipes_are_srt_slurms_bytes_and_only_those_the_mix_names() -> None:
    manifest = _manifest()
    shipped = {p.relative_to(SRT).as_posix() for p in SRT.rglob("*.yaml")}
    assert shipped == set(manifest) and len(shipped) == 201
    for relative, (_, blob) in manifest.items():
        assert _git_blob_id((SRT / relative).read_bytes()) == blob, relative
    commits = [commit for commit, _ in manifest.values()]
    assert (commits.count("c88ef731"), commits.count("deb1dfd9")) == (175, 26)
    named = {
        r["recipe"].split(":", 1)[0].removeprefix("recipes/")
        for r in MIX_ROWS
        if NOT_CHECKED_IN in r["node_count_source"]
    }
    # what the mix names but srt-slurm holds at neither commit is InferenceX's (next test)
    elsewhere = named - shipped
    assert len(elsewhere) == 19 and not any(p.startswith(("b200", "trtllm")) for p in elsewhere)
    assert (SRT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "NVIDIA" in (SRT / "NOTICE").read_text()


def test_the_inferencex_files_are_shipped_byte_for_byte_and_every_named_file_is_shipped() -> None:
    manifest = _manifest(BRANCH)
    shipped = {p.relative_to(BRANCH).as_posix() for p in BRANCH.rglob("*.yaml")}
    assert shipped == set(manifest) and len(shipped) == 19
    for relative, (_, blob) in manifest.items():
        assert _git_blob_id((BRANCH / relative).read_bytes()) == blob, relative
    commits = [commit for commit, _ in manifest.values()]
    assert (commits.count("843c6254"), commits.count("1befac52")) == (17, 2)
    assert (BRANCH / "LICENSE").read_text().lstrip().startswith("Apache License")
    # every row names a shipped file now, or no file at all (the 48 AMD rows and TileRT's 2)
    unnamed = [r for r in MIX_ROWS if _recipe(r) is None]
    assert len(unnamed) == 50 and all(not r["recipe"] for r in unnamed)
    # the llm-d rows name the llm-d router's config, not a recipe of srt-slurm's
    for path in BRANCH_LLM_D.glob("*.yaml"):
        assert parse_yaml(path.read_text(), str(path))["kind"] == "EndpointPickerConfig"


def _build(ref: str) -> RecipeSpec | InputError:
    try:
        return spec_from_recipe(ref)
    except InputError as exc:  # RecipeRefused, RecipeError (RecipeSelectorError)
        return exc


def _matrix_row(r: dict[str, str]) -> dict[str, Any]:
    """The matrix row the mix's line came from: both roles name the recipe in CONFIG_FILE."""

    override = r["node_count_source"].startswith("override")

    def role(name: str, key: str) -> dict[str, Any]:
        workers, tp = (int(x) for x in r[f"{name}_workers_x_tp"].split("x"))
        settings = [f"CONFIG_FILE={r['recipe']}"]
        if override:  # the row's own PREFILL_NODES / DECODE_NODES, which the mix counted
            settings.append(f"{key}={r[f'{name}_nodes']}")
        return {"num-worker": workers, "tp": tp, "additional-settings": settings}

    return {
        "runner": r["hardware"],
        "multinode": True,
        "disagg": r["disagg"] == "True",
        "prefill": role("prefill", "PREFILL_NODES"),
        "decode": role("decode", "DECODE_NODES"),
    }


def _recipe(r: dict[str, str]) -> tuple[Path, str] | None:
    """A row's recipe folder as admission reads it and the recipe `spec from-recipe` is given:
    the mapping scripts/job-mix-table.py writes docs/job-mix.md with, so both read rows alike."""
    return _TABLE.recipe_of(r)  # type: ignore[no-any-return]


def _refusal(exc: InputError) -> str:
    text = str(exc)
    for words, reason in (
        ("fix the recipe's node count", "idle reserved nodes"),
        ("holds several recipes", "variant file without a selector"),
        ("apiVersion, dataLayer, decode, kind", "an llm-d router config, not a recipe"),
    ):
        if words in text:
            return reason
    raise AssertionError(f"an unnamed refusal: {text}")


# The rows whose count from the recipe differs from the mix's, which counted from topology
# because InferenceX does not check the recipe in: srt-slurm asks Slurm for prefill_nodes +
# decode_nodes, and these variants reserve nodes their packed 4-GPU prefill workers leave idle
# (2 workers on 2 nodes where 1 holds both; 7 on 7 where 4 do). Admission without the recipe
# under-counts them.
UNDER_COUNTED = {
    "dsr1-fp4-b200-dynamo-sglang#2": (6, 7),
    "dsr1-fp4-b200-dynamo-sglang#4": (6, 9),
}


@functools.cache
def _libyaml(text: str) -> Any:
    return yaml.load(text, Loader=yaml.CSafeLoader)


def _parse_once(text: str, *args: Any, **kwargs: Any) -> Any:
    """The document `text` holds, parsed once per text by libyaml: 428 recipes parsed twice each
    by the pure-Python bounded loader take most of a minute; the bounded loader's checks are
    tested on hostile files in test_recipes.py, and it reads these files the same (below)."""
    return copy.deepcopy(_libyaml(text))


def test_the_fast_parse_reads_recipes_as_the_bounded_loader_does() -> None:
    for path in (VARIANTS, SRT / "gb200-fp4/8k1k/max-tpt.yaml", next(INFERENCEX.rglob("*.yaml"))):
        text = path.read_text()
        assert _parse_once(text) == parse_yaml(text, str(path)), path


def test_every_mix_row_with_a_shipped_recipe_converts_with_admissions_node_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All 648 rows: each row whose recipe is shipped is counted by `slurmgate.ci.nodecount`
    from its recipe (a selector resolved), and its spec needs exactly those nodes; each
    refusal is named. The tally is this PR's report of what runs."""
    monkeypatch.setattr(documents, "parse_yaml", _parse_once)
    monkeypatch.setattr(recipes, "parse_yaml", _parse_once)
    outcomes: dict[str, int] = {}
    builds: dict[str, RecipeSpec | InputError] = {}
    under: dict[str, tuple[int, int]] = {}
    for r in MIX_ROWS:
        found = _recipe(r)
        if found is None:
            key = f"no recipe ({r['node_count_source']})"
            outcomes[key] = outcomes.get(key, 0) + 1
            continue
        root, ref = found
        kind = {INFERENCEX: "inferencex", SRT: "srt-slurm"}.get(root, "inferencex-branch")
        if ref not in builds:
            builds[ref] = _build(ref)
        built = builds[ref]
        try:
            admitted: int | None = node_count(_matrix_row(r), FAMILY_GPUS, root)
        except NodeCountError as exc:
            assert isinstance(built, InputError) and str(built).split(": ", 1)[1] in str(exc)
            admitted = None
        if admitted is not None and admitted != int(r["total_nodes"]):
            under[r["row_id"]] = (int(r["total_nodes"]), admitted)
        if isinstance(built, InputError):
            key = f"{kind}: refused, {_refusal(built)}"
        else:
            assert built.spec.total_nodes == admitted, r["row_id"]
            assert layout.plan(built.spec).total_nodes == admitted, r["row_id"]
            assert admitted == int(r["total_nodes"]), r["row_id"]
            key = f"{kind}: spec" + (" (selector)" if ":" in r["recipe"] else "")
        outcomes[key] = outcomes.get(key, 0) + 1
    assert under == UNDER_COUNTED
    assert outcomes == {
        "inferencex: spec": 367,
        "srt-slurm: spec": 199,
        "srt-slurm: spec (selector)": 3,
        "srt-slurm: refused, idle reserved nodes": 2,
        "srt-slurm: refused, variant file without a selector": 1,
        "inferencex-branch: spec": 16,
        "inferencex-branch: spec (selector)": 7,
        "inferencex-branch: refused, an llm-d router config, not a recipe": 3,
        "no recipe (override)": 50,
    }
    assert sum(outcomes.values()) == len(MIX_ROWS) == 648


# srt-slurm's own tests of its merge (tests/test_override.py at c88ef731: TestDeepMerge,
# TestExpandZipOverride), on slurmgate's implementation.
_ZIP_BASE = {
    "name": "base-job",
    "resources": {"decode_nodes": 8},
    "backend": {
        "sglang_config": {"prefill": {"tensor-parallel-size": 4, "trust-remote-code": True}}
    },
}


def test_deep_merge_follows_srt_slurms_rules() -> None:
    base = {
        "name": "old",
        "resources": {"decode_nodes": 8},
        "benchmark": {"concurrencies": [8192, 10240]},
        "backend": {"sglang_config": {"prefill": {"tp-size": 32, "trust-remote-code": True}}},
        "extra_mount": ["/data:/data"],
    }
    override = {
        "resources": {"decode_nodes": 4},
        "benchmark": {"concurrencies": [4096]},
        "backend": {"sglang_config": {"prefill": {"tp-size": 64}}},
        "extra_mount": None,
        "environment": {"NEW_VAR": "value"},
    }
    result = variants.deep_merge(base, override)
    assert result["name"] == "old"
    assert result["resources"]["decode_nodes"] == 4
    assert result["benchmark"]["concurrencies"] == [4096]
    assert result["backend"]["sglang_config"]["prefill"] == {
        "tp-size": 64,
        "trust-remote-code": True,
    }
    assert "extra_mount" not in result
    assert result["environment"] == {"NEW_VAR": "value"}
    result["benchmark"]["concurrencies"].append(1)
    assert base["resources"]["decode_nodes"] == 8 and override["benchmark"]["concurrencies"] == [
        4096
    ]


def test_zip_variants_follow_srt_slurms_rules() -> None:
    zipped = {
        "backend": {
            "sglang_config": {
                "prefill": {
                    "tensor-parallel-size": [4, 8],
                    "mem-fraction-static": [0.85],  # broadcast
                    "trust-remote-code": False,  # scalar passthrough
                }
            }
        },
        "benchmark": {"concurrencies": [[4, 8], [4, 8, 16]]},  # a list of lists
    }
    data = {"base": _ZIP_BASE, "zip_override_tp_sweep": zipped}
    v0 = variants.select(data, "zip_override_tp_sweep[0]", "f.yaml")
    v1 = variants.select(data, "zip_override_tp_sweep[1]", "f.yaml")
    prefill0 = v0["backend"]["sglang_config"]["prefill"]
    assert prefill0 == {
        "tensor-parallel-size": 4,
        "mem-fraction-static": 0.85,
        "trust-remote-code": False,
    }
    assert v1["backend"]["sglang_config"]["prefill"]["tensor-parallel-size"] == 8
    assert (v0["benchmark"]["concurrencies"], v1["benchmark"]["concurrencies"]) == (
        [4, 8],
        [4, 8, 16],
    )
    assert v0["resources"]["decode_nodes"] == 8
    assert (v0["name"], v1["name"]) == ("base-job_tp_sweep_0", "base-job_tp_sweep_1")
    named = {"base": _ZIP_BASE, "zip_override_tp": {"name": ["job-tp4", "job-tp8"], **zipped}}
    assert variants.select(named, "zip_override_tp[1]", "f.yaml")["name"] == "job-tp8"
    assert _ZIP_BASE["resources"] == {"decode_nodes": 8}
    plain = {"base": _ZIP_BASE, "override_small": {"resources": {"decode_nodes": 2}}}
    assert variants.select(plain, "override_small", "f.yaml")["name"] == "base-job_small"
    for section, words in (
        ({"a": {"tp": [4, 8]}, "b": {"tp": [4, 8, 16]}}, r"lengths \[2, 3\]"),
        ({"backend": {"tp": 4}}, "holds no list"),
        ({"backend": {"tp": []}}, "holds an empty list"),
    ):
        with pytest.raises(variants.RecipeSelectorError, match=words):
            variants.select(
                {"base": _ZIP_BASE, "zip_override_x": section}, "zip_override_x[0]", "f"
            )


def test_a_recipes_variants_become_the_specs_srt_slurm_would_run() -> None:
    low = spec_from_recipe(f"{VARIANTS}:zip_override_stp_lowlat[1]")
    assert low.spec.name == "b200-fp4-stp-low-latency-dep4-1p-tep8-5d"  # the zip's name list
    (deployment,) = low.spec.deployments
    roles = deployment.roles
    assert (
        roles.prefill and roles.decode and (roles.prefill.workers, roles.decode.workers) == (1, 5)
    )
    assert low.spec.total_nodes == 6
    # the zip's concurrencies, sliced, for srt-slurm's sa-bench client
    assert "bench sa-bench" in low.spec.client.command[-1]
    assert "--concurrencies 8 " in low.spec.client.command[-1]
    # override_stp_tp4: nulls delete the base's DP attention, the override's scalars replace
    tp4 = spec_from_recipe(f"{VARIANTS}:override_stp_tp4").spec.deployments[0]
    prefill, decode = tp4.roles.prefill, tp4.roles.decode
    assert prefill and decode
    assert (prefill.data_parallel, prefill.expert_parallel, prefill.dp_attention) == (1, 1, False)
    assert "--enable-dp-lm-head" not in (prefill.args or [])
    assert decode.expert_parallel == 1
    base = spec_from_recipe(f"{VARIANTS}:base").spec.deployments[0].roles.prefill
    assert base and base.dp_attention and base.data_parallel == 4


@pytest.mark.parametrize(
    ("selector", "words"),
    [
        ("override_nope", "override_nope: no such section — use base, override_mtp_maxtpt_4p1d"),
        ("zip_override_stp_lowlat[3]", r"index 3 is out of range, .* has 3 variant"),
        ("zip_override_nope[0]", "no section zip_override_nope"),
        ("zip_override_stp_lowlat", "names several variants"),
        ("*mtp*", "names several variants"),
        ("overide_stp_tp4", "not a selector — write base, override_<name>"),
    ],
)
def test_a_bad_selector_is_named_with_the_selectors_the_file_has(selector: str, words: str) -> None:
    with pytest.raises(variants.RecipeSelectorError, match=words) as caught:
        spec_from_recipe(f"{VARIANTS}:{selector}")
    assert isinstance(caught.value, InputError) and "\n" not in str(caught.value)
    if "out of range" not in words and "no section" not in words:
        assert "zip_override_mtp_lowlat[0..2], zip_override_stp_lowlat[0..2]" in str(caught.value)


def test_selectors_on_the_wrong_kind_of_file_are_named() -> None:
    with pytest.raises(variants.RecipeSelectorError, match="holds several recipes") as caught:
        spec_from_recipe(VARIANTS)
    assert "base, override_mtp_maxtpt_4p1d" in str(caught.value)
    plain = SRT / "trtllm/b200-fp4/8k1k/mtp/ctx1_gen1_dep8_batch8_eplb0_mtp3.yaml"
    with pytest.raises(variants.RecipeSelectorError, match=r"has no variants .* without :base"):
        spec_from_recipe(f"{plain}:base")
    # a parsed file of variants is refused the same way, not read as unknown keys
    with pytest.raises(variants.RecipeSelectorError, match="holds several recipes"):
        from slurmgate.runtime.spec.from_recipe import spec_from_data

        spec_from_data(recipes.load(VARIANTS), source="8k1k.yaml")
    ran = CliRunner().invoke(app, ["spec", "from-recipe", f"{VARIANTS}:override_nope"])
    assert ran.exit_code == 2 and "Traceback" not in ran.output
    assert "override_nope: no such section" in ran.stderr


def test_the_cli_prints_a_variants_spec() -> None:
    ran = CliRunner().invoke(app, ["spec", "from-recipe", f"{VARIANTS}:zip_override_stp_lowlat[0]"])
    assert ran.exit_code == 0, ran.output
    assert "name: b200-fp4-stp-low-latency-dep4-1p-tep8-1d" in ran.stdout
    assert f"recipe {VARIANTS}:zip_override_stp_lowlat[0] (schema 1)" in ran.stdout


def test_node_count_counts_a_recipe_as_from_recipe_builds_it_not_as_a_one_node_row() -> None:
    """`slurmgate node-count RECIPE.yaml` once read a recipe as a matrix row and answered 1:
    a CI step passing an 18-node recipe would have asked for nodes:1. It answers the recipe's
    count, the same as the spec from-recipe builds, a variant's with FILE.yaml:selector."""
    cli = CliRunner()
    eighteen = SRT / "gb200-fp4" / "8k1k" / "max-tpt.yaml"
    for ref, nodes in ((str(eighteen), 18), (f"{VARIANTS}:zip_override_stp_lowlat[1]", 6)):
        ran = cli.invoke(app, ["node-count", ref, "--json"])
        assert ran.exit_code == 0, ran.output
        assert json.loads(ran.stdout) == {"kind": "recipe", "node-count": nodes}
        built = _build(ref)
        assert isinstance(built, RecipeSpec) and built.spec.total_nodes == nodes
        plain = cli.invoke(app, ["node-count", ref])
        assert plain.stdout.strip() == str(nodes)
    whole = cli.invoke(app, ["node-count", str(VARIANTS)])
    assert whole.exit_code == 2 and "holds several recipes" in whole.stderr
    assert "zip_override_stp_lowlat[0..2]" in whole.stderr
    bad = cli.invoke(app, ["node-count", f"{VARIANTS}:zip_override_stp_lowlat[7]"])
    assert bad.exit_code == 2 and "index 7 is out of range" in bad.stderr
    neither = cli.invoke(app, ["node-count", "-"], input="workers: 18\ngpus: 72\n")
    assert neither.exit_code == 2 and "neither an allocation spec" in neither.stderr


def test_a_rows_config_file_selector_is_resolved_by_admission() -> None:
    """A matrix row naming `recipes/FILE.yaml:selector` is counted from that variant when the
    recipe folder holds the file (InferenceX's generator, whose checkout has no such file,
    falls back to topology), and a bad selector there is the row's error, by name."""
    row = next(r for r in MIX_ROWS if r["row_id"] == "dsr1-fp4-b200-dynamo-sglang#4")
    assert node_count(_matrix_row(row), FAMILY_GPUS, SRT) == 9  # 7 prefill + 2 decode nodes
    assert node_count(_matrix_row(row), FAMILY_GPUS, INFERENCEX) == 6  # topology
    bad = {**row, "recipe": "recipes/b200-fp4/8k1k.yaml:override_nope"}
    with pytest.raises(NodeCountError, match="override_nope: no such section — use base"):
        node_count(_matrix_row(bad), FAMILY_GPUS, SRT)
    assert isinstance(
        _build(str(SRT / "b200-fp4/8k1k.yaml:override_stp_maxtpt_7p2d")), RecipeRefused
    )


@pytest.mark.parametrize(
    ("gpu_type", "bind", "numactl"),
    [
        ("gb300", None, True),  # srt-slurm's default on Grace nodes
        ("b200", None, False),
        ("b200", True, True),  # the recipe's own word wins
        ("gb300", False, False),
    ],
)
def test_a_trtllm_workers_launcher_binds_memory_as_srt_slurm_decides(
    tmp_path: Path, gpu_type: str, bind: bool | None, numactl: bool
) -> None:
    recipe = yaml.safe_load(
        (
            SRT / "trtllm/gb300-fp8/8k1k/mtp/ctx10_gen1_dep16_batch64_eplb0_mtp1_1229.yaml"
        ).read_text()
    )
    recipe["resources"]["gpu_type"] = gpu_type
    if bind is not None:
        recipe["backend"]["numa_memory_bind"] = bind
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    built = spec_from_recipe(path)
    (deployment,) = built.spec.deployments
    want = ["numactl", "-m", "0,1", "trtllm-llmapi-launch"] if numactl else ["trtllm-llmapi-launch"]
    assert deployment.mpi_launch == want
    (world,) = [w for d in layout.plan(built.spec).deployments for w in d.mpi_worlds()]
    argv = layout.lane_argv(deployment, world.head, "h", bind_host="h")
    assert argv[: len(want) + 1] == [*want, "python3"]  # then dynamo.trtllm
