"""Copy the InferenceX files the job mix names beyond the shipped recipes, byte for byte."""

# Run from the repository root: `python scripts/inferencex-branch-recipes.py --git-dir PATH`,
# PATH being the git directory of a clone of SemiAnalysisAI/InferenceX (a bare one will do)
# holding both commits of `COMMITS`. Every row of slurmgate/data/inferencex-job-mix.csv whose
# recipe is in neither tests/data/inferencex-recipes nor tests/data/srt-slurm-recipes names a
# file of InferenceX's tree: `recipes/<path>` is `benchmarks/multi_node/srt-slurm-recipes/<path>`
# (the runner scripts overlay that folder onto srt-slurm's `recipes/`), a `benchmarks/...` path
# is itself, and a bare `NAME.yaml` is `benchmarks/multi_node/llm-d-recipes/NAME.yaml` (the
# llm-d launcher's `RECIPE_PATH`). Each is taken at the mix's snapshot commit, else at the head
# of the branch that still holds it, and written to tests/data/inferencex-branch-recipes/<its
# path>; the manifest table of that folder's SOURCE.md (path, branch, commit, blob) is printed.

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

MIX = Path("slurmgate/data/inferencex-job-mix.csv")
OUT = Path("tests/data/inferencex-branch-recipes")
SRT = Path("tests/data/srt-slurm-recipes")
SRT_RECIPES = "benchmarks/multi_node/srt-slurm-recipes/"
LLM_D_RECIPES = "benchmarks/multi_node/llm-d-recipes/"
# (commit, branch): the mix's snapshot on main, then the branch holding the GB300 vLLM agentic
# recipes main deleted on 2026-08-14 (the same bytes main had before)
COMMITS = (
    ("843c6254ff69b567f772f6a5fd97675af3d04431", "main"),
    (
        "1befac523ecc6320b873e799ce31cad928fcc952",
        "agent/refresh-dsv4-gb300-dynamo-vllm-agentic-mtp-disagg",
    ),
)


def repository_path(recipe: str) -> str:
    """The file a row's `recipe` column names, as a path of InferenceX's tree."""
    file = recipe.split(":", 1)[0]
    if file.startswith("recipes/"):
        return SRT_RECIPES + file.removeprefix("recipes/")
    if "/" in file:
        return file
    return LLM_D_RECIPES + file


def wanted_paths() -> list[str]:
    """The files the rows name that no other shipped folder holds, each once, in row order."""
    with MIX.open() as handle:
        rows = list(csv.DictReader(handle))
    wanted = []
    for r in rows:
        file = r["recipe"].split(":", 1)[0]
        if not file or r["node_count_source"].startswith("recipe:"):
            continue  # no recipe, or one InferenceX checks in (tests/data/inferencex-recipes)
        if file.startswith("recipes/") and (SRT / file.removeprefix("recipes/")).is_file():
            continue
        wanted.append(repository_path(r["recipe"]))
    return list(dict.fromkeys(wanted))


def _git(git_dir: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False)


def blob(git_dir: str, commit: str, path: str) -> str | None:
    done = _git(git_dir, "rev-parse", "--verify", "--quiet", f"{commit}:{path}")
    return done.stdout.decode().strip() if done.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--git-dir", required=True, help="git directory of an InferenceX clone")
    git_dir = parser.parse_args().git_dir
    for commit, where in COMMITS:
        if _git(git_dir, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            print(f"{git_dir}: commit {commit} ({where}) is missing; fetch it", file=sys.stderr)
            return 2
    table = ["| file | branch | commit | git blob |", "|---|---|---|---|"]
    missing = 0
    for path in wanted_paths():
        found = next(((c, w, b) for c, w in COMMITS if (b := blob(git_dir, c, path))), None)
        if found is None:
            print(f"not in InferenceX at either commit: {path}", file=sys.stderr)
            missing += 1
            continue
        commit, where, blob_id = found
        target = OUT / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_git(git_dir, "cat-file", "blob", blob_id).stdout)
        table.append(f"| `{path}` | `{where}` | `{commit[:8]}` | `{blob_id}` |")
    (OUT / "LICENSE").write_bytes(_git(git_dir, "show", f"{COMMITS[0][0]}:LICENSE").stdout)
    print("\n".join(table))
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
