"""A newcomer's first hour on the bundled cluster: the README's commands with no SLURM_CONF export.

`slurmgate cluster up`, then `slurmgate allocation run examples/specs/local-stub.yaml` in a shell
that never exported SLURM_CONF, shows the client's own output, and `cluster down` leaves the
suite's cluster running (it was already up). And a spec whose `python` is not on the nodes fails
its preflight in one line that names the field, with no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime import slurm
from slurmgate.runtime.records import load_records

from .conftest import EXAMPLE, assert_no_orphans, example_data

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


def test_the_readme_walk_through_needs_no_export(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    if os.environ.get("SLURMGATE_LOCAL_SLURM") != "1" and os.geteuid() != 0:
        pytest.skip("only the suite that started the cluster may call up again")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURMGATE_STATE_DIR"] = str(tmp_path / "state")
    env["SLURMGATE_RUNS_DIR"] = str(tmp_path / "runs")
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env.pop("PREFECT_API_URL", None)

    up = _slurmgate("cluster", "up", env=env)
    assert up.returncode == 0, up.stderr
    assert up.stdout == f"export SLURM_CONF={slurm_cluster['SLURM_CONF']}\n"

    run = _slurmgate("allocation", "run", str(EXAMPLE.relative_to(REPO)), env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    # The client's own lines, as it printed them.
    assert "client| chat: 4 completions through http://" in out
    assert "client| client ok: 8 completions" in out
    (run_dir,) = (tmp_path / "runs").iterdir()
    client_log = next(run_dir.glob("[0-9][0-9]-client.log"))
    assert f"client succeeded; its output: {client_log}" in out
    assert f"its step logs and record.json are in {run_dir}" in run.stdout
    assert "Traceback" not in out and "| ERROR" not in out, out

    down = _slurmgate("cluster", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert "left running" in down.stdout  # the suite started it, not `cluster up`
    assert slurm.sinfo_states(), "the suite's cluster must still answer"


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
