"""A spec whose `python` is not on the nodes fails its preflight in one line naming the field.

(The README's `cluster up` / `allocation run` / `cluster down` walk with no SLURM_CONF export runs
as written in tests/cli/test_readme.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime.records import load_records

from .conftest import assert_no_orphans, example_data

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def _slurmgate(
    *args: str, env: dict[str, str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def test_a_python_missing_on_the_nodes_fails_preflight_naming_the_field(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    data = example_data()
    data["python"] = "/nonexistent/venv/bin/python"
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["SLURMGATE_RUNS_DIR"] = str(tmp_path / "runs")
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env.pop("PREFECT_API_URL", None)
    run = _slurmgate("allocation", "run", str(spec_path), env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: allocation run failed: preflight: python: /nonexistent/venv/bin/python cannot "
        "run on node"
    ), out
    assert "No such file or directory" in last and "fix: " in last
    # The message says it all: no traceback after it, from us or from Prefect.
    assert "Traceback" not in out, out
    (record,) = load_records(tmp_path / "runs")
    assert record.status == "failed" and record.cleanup_complete is True
    assert_no_orphans(record.run_id)
