"""docs/job-mix.md is what scripts/job-mix-table.py prints, and it accounts for every mix row."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "job-mix.md"
MIX = REPO / "slurmgate" / "data" / "inferencex-job-mix.csv"


def test_docs_job_mix_md_is_what_the_script_prints() -> None:
    printed = subprocess.run(
        [sys.executable, "scripts/job-mix-table.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert DOC.read_text() == printed, (
        "docs/job-mix.md is out of date: python scripts/job-mix-table.py > docs/job-mix.md"
    )


def _tables(text: str) -> tuple[dict[str, int], list[list[str]]]:
    summary = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^\| ([^|]+) \| (\d+) \|[^|]*\|$", text, re.M)
    }
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.split("## Rows", 1)[1].splitlines()
        if line.startswith("| ") and not line.startswith("| row_id")
    ]
    return summary, rows


def test_every_row_once_with_its_nodes_and_every_refusal_named() -> None:
    summary, rows = _tables(DOC.read_text())
    with MIX.open() as handle:
        mix = list(csv.DictReader(handle))
    assert [r[0] for r in rows] == [m["row_id"] for m in mix]
    for r, m in zip(rows, mix, strict=True):
        assert (r[1], r[2]) == (m["framework"], m["total_nodes"]), r[0]
    assert all(r[4] for r in rows if r[3] == "not representable")
    assert summary == {
        "representable": 638,
        "not representable: llm-d router config, not an srt-slurm recipe": 3,
        "not representable: ATOM engine": 2,
        "not representable: TileRT engine; no recipe found": 2,
        "not representable: variant reserves idle nodes": 2,
        "not representable: file of variants named without a selector": 1,
        "total": 648,
    }
    # the AMD rows' argv is parsed by SGLang's own ServerArgs in that test; Dynamo's is not
    checked = {r[1] for r in rows if "argv checked by ServerArgs" in r[4]}
    assert checked == {"sglang-disagg"}
    parsers = (REPO / "tests" / "runtime" / "test_engine_parsers.py").read_text()
    assert "def test_sglangs_own_parser_reads_the_amd_rows_argv(" in parsers
