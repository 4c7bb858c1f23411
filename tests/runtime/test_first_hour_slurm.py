"""The first hour with allocations: `allocation run` from a newcomer's shell, and a spec whose
`python` is not on the nodes.

(The README's `cluster up` / `allocation run` / `cluster down` walk with no SLURM_CONF export runs
as written in tests/cli/test_readme.py, against the Prefect server the README starts; here the run
goes to a temporary server, with no way out to the internet.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime.ledger.records import load_records

from .conftest import EXAMPLE, assert_no_orphans, example_data

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
# What a newcomer's shell does not have: the README must get by without them.
SCRUBBED_PREFIXES = ("PREFECT_", "SLURM", "SLURMGATE_")
SCRUBBED = {"DO_NOT_TRACK", "CI"}


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
    slurm_cluster: dict[str, str], prefect_harness: None, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    data = example_data()
    data["python"] = "/nonexistent/venv/bin/python"
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["SLURMGATE_RUNS_DIR"] = str(tmp_path / "runs")
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    # the session's server: the newcomer's test below pays for a temporary one
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
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


def _step_log_patterns() -> list[str]:
    """The step log files the README names under "Running an allocation", as regexes."""
    text = (REPO / "README.md").read_text()
    paragraph = re.search(r"That directory holds (.*?)\n\n", text, flags=re.S)
    assert paragraph, "the README no longer names the run directory's files"
    names = re.findall(r"`([^`]+\.log)`", paragraph[1])
    assert names, paragraph[1]
    # `NN` is a step's two-digit number, `<deployment>` a name
    return [
        re.sub(r"<[a-z]+>", r"[\\w-]+", re.escape(name).replace("NN", r"\d\d")) for name in names
    ]


def test_allocation_run_from_a_newcomers_shell_is_quiet_and_shows_the_client(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """`cluster up`, then `allocation run` with nothing exported: no SLURM_CONF, no Prefect
    setting, no telemetry switch, and no way out to the internet (every HTTPS request goes to a
    proxy that does not answer, as on a cluster without outside access). It succeeds on a
    temporary Prefect server, says so, shows the client's output as it comes, prints no ERROR
    and no traceback, and leaves the step logs the README names."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SCRUBBED and not k.startswith(SCRUBBED_PREFIXES)
    }
    env.update(
        HOME=str(tmp_path / "home"),
        HTTPS_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost",  # the temporary Prefect server's API and events
        no_proxy="127.0.0.1,localhost",
        # the suite's cluster, wherever it runs: `cluster up` finds it there and records it
        SLURM_LOCAL_DIR=str(Path(slurm_cluster["SLURM_CONF"]).parent.parent),
    )
    (tmp_path / "home").mkdir()
    up = _slurmgate("cluster", "up", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.startswith("export SLURM_CONF="), up.stdout
    del env["SLURM_LOCAL_DIR"]  # from here on slurmgate finds the cluster by its record

    run = _slurmgate("allocation", "run", str(EXAMPLE), env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    noisy = [line for line in out.splitlines() if re.search(r"\bERROR\b|Traceback", line)]
    assert noisy == [], out[-4000:]
    assert (
        "prefect: flow runs go to a temporary local Prefect server (its runs, logs and "
        "artifacts vanish" in run.stderr
    ), run.stderr
    assert "client| chat: 4 completions through http://" in out, out[-4000:]
    assert "client| client ok: 8 completions" in out, out[-4000:]
    last = run.stdout.strip().splitlines()[-1]
    done = re.fullmatch(
        r"run (sg-local-stub-\w+) succeeded on node1,node2,node3; its step logs and "
        r"record.json are in (\S+)",
        last,
    )
    assert done, last
    run_dir = Path(done[2])
    assert run_dir.parent == tmp_path / "home" / ".cache" / "slurmgate" / "runs"
    logs = sorted(p.name for p in run_dir.glob("*.log"))
    patterns = _step_log_patterns()
    assert [name for name in logs if not any(re.fullmatch(p, name) for p in patterns)] == []
    assert [p for p in patterns if not any(re.fullmatch(p, name) for name in logs)] == []
    assert "client ok: 8 completions" in next(run_dir.glob("[0-9][0-9]-client.log")).read_text()
    (record,) = load_records(run_dir.parent)
    assert record.status == "succeeded" and record.cleanup_complete is True
    assert_no_orphans(record.run_id)
    down = _slurmgate("cluster", "down", env=env)
    assert down.returncode == 0 and "left running" in down.stdout, down.stdout + down.stderr
