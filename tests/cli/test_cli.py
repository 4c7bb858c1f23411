"""The `slurmgate` command line: every command the README names exists, helps, and fails cleanly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_readme import readme_command_list

REPO = Path(__file__).resolve().parents[2]
SLURMGATE = [sys.executable, "-m", "slurmgate.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SLURMGATE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        check=False,
    )


def readme_commands() -> set[str]:
    """Sub-commands the README shows in code: fenced blocks and inline `code` spans."""
    text = (REPO / "README.md").read_text()
    code = re.findall(r"```.*?```", text, flags=re.S) + re.findall(r"`[^`\n]+`", text)
    found = {m for chunk in code for m in re.findall(r"\bslurmgate ([a-z][a-z-]+)", chunk)}
    return found | {command.split()[0] for command in readme_command_list()}


@pytest.mark.parametrize("command", sorted(readme_commands()))
def test_every_readme_command_exists_with_an_example(command: str) -> None:
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    groups = {
        "cluster": ("up", "down"),
        "allocation": ("run", "reap"),
        "spec": ("from-recipe", "from-row"),
        "results": ("judge", "write"),
        "bench": ("sa-bench", "aiperf"),
    }
    if command in groups:  # groups: their commands carry the examples
        assert "Commands" in out.stdout
        for sub in groups[command]:
            help_text = run(command, sub, "--help")
            assert help_text.returncode == 0 and "Example" in help_text.stdout, help_text.stdout
    else:
        assert "Example" in out.stdout, out.stdout


def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path) -> None:
    out = run("loadgen", "http://127.0.0.1:9", "--concurrency", "0")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "concurrency" in out.stderr
    assert "Traceback" not in out.stderr
    out = run("status", "--repo", "a/b", env={"GITHUB_TOKEN": ""})
    assert out.returncode == 2 and "GITHUB_TOKEN" in out.stderr
    out = run("status", "--repo", "not a repo", env={"GITHUB_TOKEN": "x"})
    assert out.returncode == 2 and "repo" in out.stderr and "Traceback" not in out.stderr
    # through the one door into the Prefect layer, refused before any Prefect server starts
    out = run("demo", "--load", "0", "--workdir", str(tmp_path))
    assert out.returncode == 2 and "--load 0 must be above 0" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "temporary server" not in out.stderr


def test_status_shows_the_board_of_a_live_scope() -> None:
    from slurmgate.testbed.emulator.testing import running_emulator

    with running_emulator({"h100": 4}, legacy=1) as emu:
        wide = ["self-hosted", "cluster:h100", "nodes:9", "ci-job-2.000-wide", "ci-attempt-1"]
        job = emu.admin.add_job(wide, duration_s=60)["id"]
        out = run(
            "status",
            "--api-url",
            emu.url,
            "--repo",
            emu.repo,
            "--json",
            env={
                "GITHUB_TOKEN": emu.token,
                "PRIORITY_SCHEDULER_ENABLED": "true",
                "NODE_SLOT_SCHEDULER_ENABLED": "true",
            },
        )
        assert out.returncode == 0, out.stderr
        rows = {row["pool"]: row for row in json.loads(out.stdout)}
        assert rows["cluster:h100"]["online"] == 4 and rows["cluster:h100"]["free"] == 4
        assert f"job {job} (9n): larger-than-any-compatible-pool" in rows["cluster:h100"]["blocked"]
        assert rows["(legacy)"]["runners"] == 1
        # status only reads: no label was written
        assert emu.admin.stats()["writes"] == 0


def test_status_never_folds_a_pool_name() -> None:
    """A narrow terminal used to fold a long pool name mid-word across table rows."""
    from slurmgate.testbed.emulator.testing import running_emulator

    pool = "cluster:h100-eu-west-reservation-long-name"
    flags = {"PRIORITY_SCHEDULER_ENABLED": "true", "NODE_SLOT_SCHEDULER_ENABLED": "true"}
    with running_emulator({pool.removeprefix("cluster:"): 3}) as emu:
        emu.admin.add_job(["self-hosted", pool, "nodes:4"], 60)
        for columns in ("60", "90", "200"):
            out = run(
                "status",
                *("--api-url", emu.url, "--repo", emu.repo),
                env={"GITHUB_TOKEN": emu.token, "COLUMNS": columns, **flags},
            )
            assert out.returncode == 0 and out.stderr == "", out.stderr
            assert pool in out.stdout, out.stdout
            assert "larger-than-any-compatible-pool" in out.stdout, out.stdout
            assert all(len(line) <= int(columns) for line in out.stdout.splitlines())
            assert ("slurmgate pools" in out.stdout) == (columns == "200")  # the table
        # with the flags off nothing is admitted or blocked: say so, instead of a silent board
        out = run("status", "--api-url", emu.url, "--repo", emu.repo, env={"GITHUB_TOKEN": "x"})
        assert out.returncode == 0
        assert out.stderr.startswith("note: PRIORITY_SCHEDULER_ENABLED is off, so nothing")
        assert len(out.stderr.splitlines()) == 1


def test_reap_without_slurm_is_one_line_and_keeps_the_record(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_OUT)
    record = {
        "run_id": "sg-cli-reap-1",
        "status": "running",
        "job_id": "4242",
        "owned_allocation": True,
        "controller_pid": int(dead.stdout),
        "controller_host": os.uname().nodename,
        "steps": [],
    }
    path = tmp_path / "sg-cli-reap-1" / "record.json"
    path.parent.mkdir()
    path.write_text(json.dumps(record))
    out = run("allocation", "reap", "--runs-dir", str(tmp_path), env={"PATH": str(tmp_path)})
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert "Slurm did not answer" in out.stderr and "SLURM_CONF" in out.stderr
    assert json.loads(path.read_text())["status"] == "running"  # nothing lost, retried later


_OUT: dict[str, bool] = {"capture_output": True, "text": True, "check": True}


def test_spec_from_recipe_prints_a_spec_and_names_what_runs_differently(tmp_path: Path) -> None:
    recipe = (
        REPO
        / "tests/data/inferencex-recipes-schema2/vllm/kimi-k3/agentic/agg-b200-tp8pp2-agentic.yaml"
    )
    done = run("spec", "from-recipe", str(recipe), "--model", "/models/kimi")
    assert done.returncode == 0, done.stderr
    assert "reported: model.container:" in done.stderr
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(done.stdout)
    assert run("node-count", str(spec_file)).stdout.strip() == "2"
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 2\nname: x\nroles: {warmup: {}}\n")
    refused = run("spec", "from-recipe", str(bad))
    assert refused.returncode == 2 and "roles.warmup: unknown role" in refused.stderr
    assert "Traceback" not in refused.stderr
    both = run("allocation", "run", str(spec_file), "--recipe", str(recipe))
    assert both.returncode == 2 and "give a spec, or --recipe" in both.stderr


def test_spec_from_row_prints_a_spec_with_admissions_node_count(tmp_path: Path) -> None:
    done = run("spec", "from-row", "dsr1-fp8-mi355x-sglang-disagg#0", "--model", "/models/r1")
    assert done.returncode == 0, done.stderr
    assert "reported: setup_deps.sh:" in done.stderr
    assert done.stdout.startswith("# From the InferenceX job-mix row dsr1-fp8-mi355x-sglang")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(done.stdout)
    assert run("node-count", str(spec_file)).stdout.strip() == "3"  # the mix's total_nodes
    refused = run("spec", "from-row", "dsv4-fp4-mi355x-atom-disagg#1")
    assert refused.returncode == 2 and "atom-disagg: cannot be represented" in refused.stderr
    assert "Traceback" not in refused.stderr
