"""Print docs/job-mix.md: whether each of the job mix's rows is representable, and if not, why."""

# Run from the repository root: `python scripts/job-mix-table.py > docs/job-mix.md`; a test
# checks that docs/job-mix.md holds exactly this output. A row is representable when its spec
# builds (`spec from-recipe`'s spec_from_recipe for a recipe row, `spec from-row`'s
# spec_from_row for an AMD row), the spec's node count equals admission's
# (`slurmgate.ci.nodecount`) and the mix's `total_nodes`, and its framework's family has a
# recipe that ran with `--local` (benchmarks/results/local_recipes.md).

from __future__ import annotations

import copy
import csv
import functools
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from slurmgate import documents
from slurmgate.ci.nodecount import NodeCountError, node_count
from slurmgate.errors import InputError
from slurmgate.runtime.spec import from_row, recipes
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.from_recipe import spec_from_recipe

REPO = Path(__file__).resolve().parents[1]
MIX = REPO / "slurmgate" / "data" / "inferencex-job-mix.csv"
LOCAL = REPO / "benchmarks" / "results" / "local_recipes.md"
PARSERS = REPO / "tests" / "runtime" / "test_engine_parsers.py"
DATA = REPO / "tests" / "data"
INFERENCEX = DATA / "inferencex-recipes"
SRT = DATA / "srt-slurm-recipes"
BRANCH = DATA / "inferencex-branch-recipes"
BRANCH_SRT = BRANCH / "benchmarks" / "multi_node" / "srt-slurm-recipes"
BRANCH_LLM_D = BRANCH / "benchmarks" / "multi_node" / "llm-d-recipes"
# GPUs per node by GPU family, as the mix's gpus_per_node column says
FAMILY_GPUS = {"b200": 8, "b300": 8, "h100": 8, "h200": 8, "mi355x": 8, "gb200": 4, "gb300": 4}
# the mix's framework -> the engine family whose recipes local_recipes.md names by folder
FAMILY = {
    "dynamo-sglang": "sglang",
    "sglang-disagg": "sglang",
    "dynamo-trt": "trtllm",
    "dynamo-vllm": "vllm",
    "vllm": "vllm",
    "llmd-vllm": "vllm",
}
# frameworks whose launch argv SGLang's own parser reads in PARSERS (that test's name)
PARSER_CHECKED = {"sglang-disagg": "test_sglangs_own_parser_reads_the_amd_rows_argv"}
# a refusal's words -> the reason the table names
REFUSALS = (
    ("fix the recipe's node count", "variant reserves idle nodes"),
    ("holds several recipes", "file of variants named without a selector"),
    ("apiVersion, dataLayer, decode, kind", "llm-d router config, not an srt-slurm recipe"),
    ("framework atom-disagg: cannot be represented", "ATOM engine"),
)
REPRESENTABLE = "representable"


def mix() -> list[dict[str, str]]:
    with MIX.open() as handle:
        return list(csv.DictReader(handle))


def ran_locally() -> Counter[str]:
    """Recipes local_recipes.md says ran, by family (their first folder)."""
    ran: Counter[str] = Counter()
    for line in LOCAL.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 2 and cells[1] == "ran" and "/" in cells[0]:
            ran[cells[0].split("/", 1)[0]] += 1
    return ran


def recipe_of(r: dict[str, str]) -> tuple[Path, str] | None:
    """Admission's recipe folder for the row and the reference `spec from-recipe` is given
    (tests/data/inferencex-branch-recipes/SOURCE.md maps the names); None: no recipe file."""
    recipe = r["recipe"]
    file = recipe.split(":", 1)[0]
    if r["node_count_source"].startswith("recipe:"):
        return INFERENCEX, str(INFERENCEX / recipe.removeprefix("recipes/"))
    if not file:
        return None
    if file.startswith("recipes/"):
        relative = recipe.removeprefix("recipes/")
        if (SRT / file.removeprefix("recipes/")).is_file():
            return SRT, str(SRT / relative)
        return BRANCH_SRT, str(BRANCH_SRT / relative)
    if "/" in file:
        return BRANCH, str(BRANCH / recipe)
    return BRANCH_SRT, str(BRANCH_LLM_D / recipe)


def matrix_row(r: dict[str, str]) -> dict[str, Any]:
    """The NVIDIA matrix row a mix row came from: both roles name the recipe in CONFIG_FILE,
    and an `override` row keeps its own PREFILL_NODES / DECODE_NODES."""
    override = r["node_count_source"].startswith("override")

    def role(name: str, key: str) -> dict[str, Any]:
        workers, tp = (int(x) for x in r[f"{name}_workers_x_tp"].split("x"))
        settings = [f"CONFIG_FILE={r['recipe']}"]
        if override:
            settings.append(f"{key}={r[f'{name}_nodes']}")
        return {"num-worker": workers, "tp": tp, "additional-settings": settings}

    return {
        "runner": r["hardware"],
        "multinode": True,
        "disagg": r["disagg"] == "True",
        "prefill": role("prefill", "PREFILL_NODES"),
        "decode": role("decode", "DECODE_NODES"),
    }


def refusal(exc: InputError) -> str:
    text = str(exc)
    for words, reason in REFUSALS:
        if words in text:
            return reason
    raise SystemExit(f"an unnamed refusal; name it in REFUSALS: {text}")


@functools.cache
def _spec(ref: str) -> AllocationSpec | str:
    try:
        return spec_from_recipe(ref).spec
    except InputError as exc:
        return refusal(exc)


def build(r: dict[str, str]) -> tuple[AllocationSpec | str, int | str]:
    """The row's spec (or why it is refused) and admission's node count (or its error)."""
    if r["source_file"] == from_row.SOURCE:
        try:
            built: AllocationSpec | str = from_row.spec_from_row(r["row_id"]).spec
        except InputError as exc:
            built = refusal(exc)
        return built, node_count(from_row.matrix_row(r["row_id"]), FAMILY_GPUS)
    found = recipe_of(r)
    if found is None:
        return "no recipe found", node_count(matrix_row(r), FAMILY_GPUS)
    root, ref = found
    try:
        admitted: int | str = node_count(matrix_row(r), FAMILY_GPUS, root)
    except NodeCountError as exc:
        admitted = str(exc)
    return _spec(ref), admitted


def classify(r: dict[str, str], ran: Counter[str]) -> tuple[str, str]:
    """(outcome, reason): `representable` with a note, or `not representable` and why."""
    framework, total = r["framework"], int(r["total_nodes"])
    if framework == "tilert":
        return "not representable", "TileRT engine; no recipe found"
    built, admitted = build(r)
    if isinstance(built, str):
        return "not representable", built
    if not built.total_nodes == admitted == total:
        return "not representable", (
            f"node count: spec {built.total_nodes}, admission {admitted}, mix {total}"
        )
    family = FAMILY[framework]
    if not ran[family]:
        return "not representable", f"no {family} recipe ran with --local"
    test = PARSER_CHECKED.get(framework)
    note = f"argv checked by ServerArgs in {PARSERS.relative_to(REPO)}" if test else ""
    return REPRESENTABLE, note


def _parse_once() -> None:
    """Parse each recipe text once, by libyaml: the pure-Python bounded loader takes most of a
    minute over these files; it reads them the same (tests/ci/test_srt_slurm_recipes.py), and
    its bounds, which guard against hostile files, are tested in tests/ci/test_recipes.py."""
    bounded = documents.parse_yaml
    done: dict[str, Any] = {}

    def parse(
        text: str, source: str, *, max_bytes: int = documents.MAX_DOCUMENT_BYTES, kind: str = "YAML"
    ) -> Any:
        if len(text.encode()) > max_bytes:
            return bounded(text, source, max_bytes=max_bytes, kind=kind)  # refused by name
        if text not in done:
            done[text] = yaml.load(text, Loader=yaml.CSafeLoader)
        return copy.deepcopy(done[text])

    documents.parse_yaml = parse  # type: ignore[assignment]
    recipes.parse_yaml = parse  # type: ignore[assignment]


HEADER = """\
# The job mix, row by row

<!-- Generated by `python scripts/job-mix-table.py > docs/job-mix.md`: a test checks it. -->

Each of the {rows} rows of the InferenceX job mix (`slurmgate/data/inferencex-job-mix.csv`) and
whether slurmgate can run it. A row is **representable** when all of these hold:

- its spec builds: a row with a recipe through `slurmgate spec from-recipe` (the recipes ship in
  `tests/data/inferencex-recipes/`, `tests/data/srt-slurm-recipes/` and
  `tests/data/inferencex-branch-recipes/`, each with its source), an AMD row of
  `configs/amd-master.yaml` through `slurmgate spec from-row`;
- the spec's node count equals admission's (`slurmgate.ci.nodecount`, what a CI job asks for)
  and the mix's `total_nodes` (the `nodes` column);
- its framework's engine family has a recipe that ran with `--local` on the bundled cluster in
  `benchmarks/results/local_recipes.md` ({ran}).

Engine families:
{families}.

Every other row names why. Where a test parses a framework's argv with the engine's own parser,
the row says so (SGLang's `ServerArgs`; this script does not run it).
"""


def main() -> int:
    _parse_once()
    rows = mix()
    ran = ran_locally()
    text = PARSERS.read_text()
    for framework, test in PARSER_CHECKED.items():
        if f"def {test}(" not in text:
            print(f"{PARSERS}: no {test} for {framework}", file=sys.stderr)
            return 1
    results = [(r, *classify(r, ran)) for r in rows]
    tally = Counter(
        outcome if outcome == REPRESENTABLE else f"{outcome}: {reason}"
        for _, outcome, reason in results
    )
    families = "; ".join(
        f"{family}: {', '.join(k for k, v in FAMILY.items() if v == family)}"
        for family in dict.fromkeys(FAMILY.values())
    )
    out = [
        HEADER.format(
            rows=len(rows),
            families=families,
            ran=", ".join(f"{f} {n} ran" for f, n in sorted(ran.items())),
        ),
        "## Summary",
        "",
        "| outcome | rows | frameworks |",
        "|---|---|---|",
    ]
    by_framework: dict[str, Counter[str]] = {}
    for r, outcome, reason in results:
        key = outcome if outcome == REPRESENTABLE else f"{outcome}: {reason}"
        by_framework.setdefault(key, Counter())[r["framework"]] += 1
    order = sorted(tally, key=lambda k: (k != REPRESENTABLE, -tally[k], k))
    for key in order:
        shown = ", ".join(f"{f} {n}" for f, n in sorted(by_framework[key].items()))
        out.append(f"| {key} | {tally[key]} | {shown} |")
    out += [f"| total | {sum(tally.values())} | |", "", "## Rows", ""]
    out += ["| row_id | framework | nodes | outcome | reason |", "|---|---|---|---|---|"]
    for r, outcome, reason in results:
        out.append(
            f"| {r['row_id']} | {r['framework']} | {r['total_nodes']} | {outcome} | {reason} |"
        )
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
