"""The example workflows' `run:` steps as GitHub runs them, in a repository that is not slurmgate.

Each job's steps run in order in GitHub's shell (`bash --noprofile --norc -eo pipefail`), with
the runner's default environment (the GITHUB_* ids and files, RUNNER_NAME, a plain PATH), the
job's and the step's `env:` resolved from the context GitHub would give (inputs, vars, secrets,
needs, steps), in the workspace of a checkout of a user's repository. `uses:` steps are GitHub's
actions: checkout is that workspace, setup-python the labels runner's fresh Python. Everything
runs against the GitHub emulator, a Prefect server with basic auth (as the README prescribes for
a server others reach) and the bundled Slurm cluster; slurmgate comes from the built wheel.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator
from slurmgate.testbed.localproc import stop_group
from slurmgate.testbed.prefect_server import PrefectServerProcess, running_prefect_server

pytestmark = [pytest.mark.slurm, pytest.mark.prefect_server]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "github"
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
POOL = "slurm-ci"
AUTH = "ci:workflow-AUTH-pass"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def evaluate(expr: str, context: dict[str, str]) -> str:
    """The expressions these workflows use: a reference, or `a || 'literal'`."""
    for alternative in (part.strip() for part in expr.split("||")):
        if alternative.startswith("'") and alternative.endswith("'"):
            return alternative[1:-1]
        assert alternative in context, f"the workflow uses {alternative!r}, unknown to the test"
        if context[alternative]:
            return context[alternative]
    return ""


def resolve(env: dict[str, Any], context: dict[str, str]) -> dict[str, str]:
    return {k: EXPR.sub(lambda m: evaluate(m.group(1), context), str(v)) for k, v in env.items()}


@dataclass
class JobRun:
    """One job's steps run as GitHub runs them; what they printed and wrote."""

    workspace: Path
    home: Path
    base_env: dict[str, str]
    context: dict[str, str]
    path_dirs: list[str] = field(default_factory=list)
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    # what an upload-artifact step would upload: its path patterns, matched after the steps
    uploaded: list[str] = field(default_factory=list)

    def run(self, job: dict[str, Any]) -> bool:
        """Every step in order; after a failure only `if: always()` steps run. True if all
        succeeded."""
        failed = False
        for index, step in enumerate(job["steps"]):
            name = step.get("name") or step.get("uses") or f"step {index}"
            if "uses" in step:
                action = step["uses"].split("@")[0]
                known = ("actions/checkout", "actions/setup-python", "actions/upload-artifact")
                assert action in known, action
                if action == "actions/checkout":  # the workspace is the checkout
                    assert step["with"]["persist-credentials"] is False
                if action == "actions/upload-artifact":  # GitHub's; what its paths match
                    assert step.get("if") == "always()", step
                    temp = self.base_env["RUNNER_TEMP"]
                    for pattern in step["with"]["path"].splitlines():
                        pattern = pattern.replace("${{ runner.temp }}", temp)
                        self.uploaded += sorted(glob.glob(pattern))
                continue
            if failed and step.get("if") != "always()":
                continue
            files = self.home / f"step-{index}"
            files.mkdir()
            env = {**self.base_env, **resolve(job.get("env", {}), self.context)}
            env.update(resolve(step.get("env", {}), self.context))
            env["GITHUB_OUTPUT"] = str(files / "output")
            env["GITHUB_PATH"] = str(files / "path")
            env["PATH"] = os.pathsep.join([*reversed(self.path_dirs), self.base_env["PATH"]])
            script = files / "script.sh"
            script.write_text(step["run"])
            done = subprocess.run(
                ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
                cwd=self.workspace, env=env, capture_output=True, text=True, timeout=600,
                check=False,
            )  # fmt: skip
            self.logs[name] = done.stdout + done.stderr
            (files / "log").write_text(self.logs[name])  # each step's log, as GitHub keeps it
            if done.returncode != 0:
                failed = True
                continue
            written = (files / "output").read_text() if (files / "output").exists() else ""
            pairs = dict(line.split("=", 1) for line in written.splitlines() if "=" in line)
            self.outputs[step.get("id", name)] = pairs
            for key, value in pairs.items():
                self.context[f"steps.{step.get('id')}.outputs.{key}"] = value
            if (files / "path").exists():
                self.path_dirs += (files / "path").read_text().split()
        return not failed


@dataclass
class Site:
    """What a team running the workflows has: GitHub, a Prefect server, Slurm, a venv."""

    emu: RunningEmulator
    server: PrefectServerProcess
    bindir: Path
    wheel: Path
    root: Path

    def env(self, **extra: str) -> dict[str, str]:
        """An operator's environment: this venv, this server, no checkout importable."""
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SLURM_J"))}
        keep.pop("PYTHONPATH", None)
        return {
            **keep,
            "PATH": f"{self.bindir}{os.pathsep}{SYSTEM_PATH}",
            "HOME": str(self.root / "operator"),
            "PREFECT_API_URL": self.server.api_url,
            "PREFECT_API_AUTH_STRING": AUTH,
            "PREFECT_HOME": str(self.root / "operator" / "prefect"),
            "GITHUB_TOKEN": self.emu.token,
            "DO_NOT_TRACK": "1",
            **extra,
        }


@pytest.fixture(scope="module")
def site(
    slurm_cluster: dict[str, str], wheel_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("site")
    (root / "operator").mkdir()
    (wheel,) = (wheel_venv.parent.parent / "dist").glob("slurmgate-*.whl")
    with (
        running_emulator({POOL: 4}, repo="acme/gpu-ci") as emu,
        running_prefect_server(root / "server", auth=AUTH) as server,
    ):
        yield Site(emu, server, wheel_venv, wheel, root)


def user_repository(root: Path) -> Path:
    """A checkout of a user's repository: their spec and the two workflows, no slurmgate."""
    workspace = root / "acme-gpu-ci"
    (workspace / ".github" / "workflows").mkdir(parents=True)
    for name in ("benchmark.yml", "slurmgate-job.yml"):
        shutil.copy(EXAMPLES / name, workspace / ".github" / "workflows" / name)
    (workspace / "ci").mkdir()
    spec = yaml.safe_load((REPO / "examples" / "specs" / "local-stub.yaml").read_text())
    spec["deployments"] = spec["deployments"][:1]  # one node: its client checks one endpoint
    client = spec["client"]["command"][-1]
    assert "len(endpoints) == 2" in client
    spec["client"]["command"][-1] = client.replace("len(endpoints) == 2", "len(endpoints) == 1")
    (workspace / "ci" / "stub.yaml").write_text(yaml.safe_dump(spec))
    return workspace


def labels_runner(root: Path) -> Path:
    """The GitHub-hosted runner's Python after setup-python: a venv without slurmgate.

    pip installs without dependencies here (PIP_NO_DEPS in the runner's environment): they come
    from the test's environment through a path file, as in the wheel fixture.
    """
    venv = root / "setup-python"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_dir = subprocess.run(
        [str(venv / "bin" / "python"), "-c", purelib], capture_output=True, text=True, check=True
    ).stdout.strip()
    Path(site_dir, "zz-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def runner_env(root: Path, emu: RunningEmulator, run_id: int, runner: str) -> dict[str, str]:
    """The default environment GitHub gives a job's steps on a runner."""
    temp = root / "runner-temp"
    temp.mkdir(exist_ok=True)
    return {
        "PATH": SYSTEM_PATH,
        "HOME": str(root / "runner-home"),
        "LANG": "C.UTF-8",
        "CI": "true",
        "GITHUB_ACTIONS": "true",
        "GITHUB_API_URL": emu.url,
        "GITHUB_REPOSITORY": emu.repo,
        "GITHUB_RUN_ID": str(run_id),
        "GITHUB_RUN_ATTEMPT": "1",
        "GITHUB_EVENT_NAME": "push",
        "GITHUB_WORKSPACE": str(root / "acme-gpu-ci"),
        "RUNNER_NAME": runner,
        "RUNNER_TEMP": str(temp),
        "SLURM_CONF": os.environ["SLURM_CONF"],  # the runner host's Slurm client
    }


def test_the_workflows_run_as_github_runs_them_in_a_users_repository(site: Site) -> None:
    root, emu = site.root, site.emu
    workspace = user_repository(root)
    (root / "runner-home").mkdir()
    reusable = load(workspace / ".github" / "workflows" / "slurmgate-job.yml")
    context = {
        "inputs.runner": f"cluster:{POOL}",
        "inputs.spec": "ci/stub.yaml",
        "inputs.skip-queue-pr": "",
        "inputs.slurmgate-package": str(site.wheel),
        "vars.PRIORITY_SCHEDULER_ENABLED": "true",
        "vars.NODE_SLOT_SCHEDULER_ENABLED": "true",
        "vars.SLURMGATE_VENV": str(site.bindir.parent),
        "vars.PREFECT_API_URL": site.server.api_url,
        "vars.SLURMGATE_OUTPUTS_BUCKET": "",
        "secrets.PREFECT_API_AUTH_STRING": AUTH,
        "github.token": emu.token,
    }

    # The operator's side, once: blocks and the release-lease deployment, served.
    init = subprocess.run(
        [str(site.bindir / "slurmgate"), "init", "--api-url", emu.url, "--repo", emu.repo,
         "--priority-scheduler", "--node-slot-scheduler"],
        env=site.env(), cwd=root / "operator", capture_output=True, text=True, timeout=180,
        check=False,
    )  # fmt: skip
    assert init.returncode == 0, init.stdout + init.stderr
    served_log = (root / "serve.log").open("wb")
    served = subprocess.Popen(
        [str(site.bindir / "python"), "-m", "slurmgate.deployments.serve", "--only",
         "release-lease", "--interval", "0"],
        env=site.env(), cwd=root / "operator", stdout=served_log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        # Job `labels`, on a GitHub-hosted runner.
        labels_bin = labels_runner(root)
        env = runner_env(root, emu, run_id=4100, runner="GitHub Actions 1")
        env.update(PATH=f"{labels_bin}{os.pathsep}{SYSTEM_PATH}", PIP_NO_DEPS="1")
        labels = JobRun(workspace, root / "labels-job", env, dict(context))
        labels.home.mkdir()
        assert labels.run(reusable["jobs"]["labels"]), labels.logs
        emitted = labels.outputs["labels"]
        runs_on = json.loads(emitted["runs-on"])
        assert runs_on[:2] == ["self-hosted", f"cluster:{POOL}"], runs_on
        assert f"nodes:{emitted['nodes']}" in runs_on and int(emitted["nodes"]) <= 4, runs_on

        # GitHub queues job `benchmark` with those labels; one reconcile tick admits it and the
        # emulator dispatches it to its anchor runner.
        queued = emu.admin.add_job(runs_on, duration_s=600.0)
        tick = subprocess.run(
            [str(site.bindir / "slurmgate"), "reconcile", "--once", "--api-url", emu.url,
             "--repo", emu.repo],
            env=site.env(PRIORITY_SCHEDULER_ENABLED="true", NODE_SLOT_SCHEDULER_ENABLED="true",
                         SLURMGATE_MIN_WRITE_INTERVAL_S="0"),
            cwd=root / "operator", capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert tick.returncode == 0, tick.stdout + tick.stderr
        job = next(j for j in emu.admin.dump()["jobs"] if j["id"] == queued["id"])
        assert job["runner_name"], job

        # Job `benchmark`, on the anchor: its runner's PATH has no slurmgate.
        for key, value in labels.outputs["labels"].items():
            context[f"needs.labels.outputs.{key}"] = value
        env = runner_env(root, emu, run_id=queued["run_id"], runner=job["runner_name"])
        bench = JobRun(workspace, root / "benchmark-job", env, context)
        bench.home.mkdir()
        ok = bench.run(reusable["jobs"]["benchmark"])
        assert ok, {name: log[-3000:] for name, log in bench.logs.items()}
        assert bench.outputs["job"]["id"] == str(queued["id"])
        assert "succeeded" in bench.logs["Run the allocation"], bench.logs["Run the allocation"]
        # the upload step finds the run's collected outputs and its record
        assert any(p.endswith("/outputs/") for p in bench.uploaded), bench.uploaded
        assert any(p.endswith("/record.json") for p in bench.uploaded), bench.uploaded
        runners = [r for r in emu.admin.dump()["runners"] if POOL in json.dumps(r)]
        leased = [r["name"] for r in runners if "ci-lease-" in json.dumps(r["labels"])]
        assert leased, "the tick leased no runner"

        # The release step created a flow run; the served deployment gives the runners back.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runners = [r for r in emu.admin.dump()["runners"] if POOL in json.dumps(r)]
            if not any("ci-lease-" in json.dumps(r["labels"]) for r in runners):
                break
            time.sleep(1.0)
        else:
            pytest.fail("the lease was not released: " + (root / "serve.log").read_text()[-3000:])
    finally:
        stop_group(served)
        served_log.close()


def test_a_runner_without_slurmgate_fails_naming_the_variable(site: Site, tmp_path: Path) -> None:
    """The first step of `benchmark` stops a runner whose PATH has neither tool, in one line."""
    reusable = load(EXAMPLES / "slurmgate-job.yml")
    env = runner_env(tmp_path, site.emu, run_id=1, runner="r")
    (tmp_path / "acme-gpu-ci").mkdir()
    context = {"vars.SLURMGATE_VENV": ""}
    job = {"steps": reusable["jobs"]["benchmark"]["steps"][:2]}
    bench = JobRun(tmp_path / "acme-gpu-ci", tmp_path / "job", env, context)
    bench.home.mkdir()
    assert not bench.run(job)
    (log,) = bench.logs.values()
    assert "::error::slurmgate is not on this runner's PATH" in log and "SLURMGATE_VENV" in log
