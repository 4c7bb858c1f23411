"""The two flags every benchmark takes: `--smoke` (small sizes) and `--results-dir DIR`.

`--smoke` runs the same side-by-side comparison at a size a test can afford (seconds, not
minutes) and marks its output as a smoke run; `--results-dir` sends the JSON and markdown (and
PNGs) somewhere other than the committed `benchmarks/results/`, so a test never overwrites them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE_NOTE = (
    "Smoke run (`--smoke`): reduced sizes or repeats, a check that it works, not a measurement."
)


def add_output_flags(parser: argparse.ArgumentParser, smoke: str) -> None:
    """Adds `--smoke` (with `smoke` saying what it shrinks) and `--results-dir`."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"small sizes for a quick check, both arms still measured: {smoke}",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS,
        metavar="DIR",
        help="where the JSON and markdown go (default: benchmarks/results)",
    )


def results_dir(args: argparse.Namespace) -> Path:
    """The results directory from the parsed flags, created if missing."""
    out: Path = args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(
    args: argparse.Namespace, stem: str, result: dict[str, object], text: str
) -> Path:
    """Write STEM.json and STEM.md (marked on a smoke run) to the results directory, and print
    the markdown; returns the directory."""
    out = results_dir(args)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text += "\n" + SMOKE_NOTE + "\n" if args.smoke else ""
    (out / f"{stem}.md").write_text(text)
    print(text)
    return out
