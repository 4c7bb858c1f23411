"""Copy the srt-slurm recipes the InferenceX job mix names, byte for byte, from a srt-slurm clone.

Run from the repository root: `python scripts/srt-slurm-recipes.py --git-dir PATH`, PATH being
the git directory of a clone of NVIDIA/srt-slurm (a bare one will do) that holds both commits
of `COMMITS`. For every row of slurmgate/data/inferencex-job-mix.csv whose `node_count_source`
says `recipe-not-checked-in`, the row's `recipe` column (its `recipes/<path>`, without a
`:selector`) is looked up in srt-slurm at `main`'s commit, else at the submission branch's; the
file is written to tests/data/srt-slurm-recipes/<path>, with srt-slurm's LICENSE and NOTICE,
and the manifest table of SOURCE.md (path, commit, git blob id) is printed on stdout. Rows whose
recipe is at neither commit are listed on stderr: they are not srt-slurm's.

With `--sa-bench` it copies srt-slurm's sa-bench client instead: every file of
`src/srtctl/benchmarks/scripts/sa-bench/` at `main`'s commit, byte for byte, to
slurmgate/data/sa-bench/ with the same LICENSE and NOTICE, and prints that folder's manifest.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

MIX = Path("slurmgate/data/inferencex-job-mix.csv")
OUT = Path("tests/data/srt-slurm-recipes")
# (commit, where it is): srt-slurm's main at the mix's snapshot, then the submission branch
COMMITS = (
    ("c88ef731636890ff6385a783e152c1790e15b194", "main"),
    ("deb1dfd9934398664f92d194169c183e009da83b", "sa-submission-q2-2026"),
)
NOT_CHECKED_IN = "recipe-not-checked-in"
# srt-slurm's sa-bench client (benchmark_serving.py and its modules), which `slurmgate bench run`
# runs as srt-slurm's bench.sh does
SA_BENCH_SOURCE = "src/srtctl/benchmarks/scripts/sa-bench"
SA_BENCH_OUT = Path("slurmgate/data/sa-bench")


def wanted_paths() -> list[str]:
    """The `recipes/...` files the mix's not-checked-in rows name, each once, in row order."""
    with MIX.open() as handle:
        rows = [r for r in csv.DictReader(handle) if NOT_CHECKED_IN in r["node_count_source"]]
    return list(dict.fromkeys(r["recipe"].split(":", 1)[0] for r in rows))


def _git(git_dir: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False)


def blob(git_dir: str, commit: str, path: str) -> str | None:
    done = _git(git_dir, "rev-parse", "--verify", "--quiet", f"{commit}:{path}")
    return done.stdout.decode().strip() if done.returncode == 0 else None


def copy_sa_bench(git_dir: str) -> list[str]:
    """Write every file of srt-slurm's sa-bench folder at main's commit; the manifest's rows."""
    commit = COMMITS[0][0]
    listing = _git(git_dir, "ls-tree", "-r", f"{commit}:{SA_BENCH_SOURCE}").stdout.decode()
    rows = []
    for line in listing.splitlines():
        meta, name = line.split("\t", 1)
        blob_id = meta.split()[2]
        target = SA_BENCH_OUT / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_git(git_dir, "cat-file", "blob", blob_id).stdout)
        rows.append(f"| `{name}` | `{commit[:8]}` | `{blob_id}` |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-dir", required=True, help="git directory of an srt-slurm clone")
    parser.add_argument("--sa-bench", action="store_true", help="copy the sa-bench client")
    parsed = parser.parse_args()
    git_dir = parsed.git_dir
    for commit, where in COMMITS:
        if _git(git_dir, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            print(f"{git_dir}: commit {commit} ({where}) is missing; fetch it", file=sys.stderr)
            return 2
    table = ["| file | commit | git blob |", "|---|---|---|"]
    out = SA_BENCH_OUT if parsed.sa_bench else OUT
    if parsed.sa_bench:
        table += copy_sa_bench(git_dir)
    for path in [] if parsed.sa_bench else wanted_paths():
        found = next(((c, w, b) for c, w in COMMITS if (b := blob(git_dir, c, path))), None)
        if not path.startswith("recipes/") or found is None:
            print(f"not in srt-slurm at either commit: {path}", file=sys.stderr)
            continue
        commit, _, blob_id = found
        target = OUT / path.removeprefix("recipes/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_git(git_dir, "cat-file", "blob", blob_id).stdout)
        table.append(f"| `{target.relative_to(OUT)}` | `{commit[:8]}` | `{blob_id}` |")
    for name in ("LICENSE", "NOTICE"):
        (out / name).write_bytes(_git(git_dir, "show", f"{COMMITS[0][0]}:{name}").stdout)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
