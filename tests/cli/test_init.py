"""`slurmgate init` saves the blocks the deployments load, on the Prefect API the user set."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmgate.testbed.emulator.testing import running_emulator
from slurmgate.testbed.prefect_server import running_prefect_server

REPO = Path(__file__).resolve().parents[2]
SLURMGATE = [sys.executable, "-m", "slurmgate.cli"]

# What a worker does with the reconcile deployment: the flow with the blocks named `default`.
WORKER_TICK = """
import asyncio, json
from slurmgate.flows.reconcile import reconcile
from slurmgate.github.scope import ScopeError

summary = asyncio.run(reconcile(scope_block="default", policy_block="default",
                                reap_allocations=False))
try:
    asyncio.run(reconcile(scope_block="missing", reap_allocations=False))
    missing = "loaded"
except ScopeError as exc:
    missing = str(exc)
print(json.dumps({"summary": summary, "missing": missing}))
"""

# Two ticks of the worker around `slurmgate uncordon`: blocked while cordoned, then admitted.
CORDONED_TICKS = """
import asyncio, json, subprocess, sys
from slurmgate.flows.reconcile import reconcile

def tick():
    return asyncio.run(reconcile(scope_block="default", policy_block="default",
                                 reap_allocations=False))

first = tick()
undo = subprocess.run([sys.executable, "-m", "slurmgate.cli", "uncordon", "h100"],
                      capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps([first, undo, tick()]))
"""


def run(
    args: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base.pop("GITHUB_TOKEN", None)
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**base, "DO_NOT_TRACK": "1", **env},
        stdin=subprocess.DEVNULL,
        check=False,
    )


def init(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run([*SLURMGATE, "init", *args], env)


def test_init_refuses_what_it_cannot_keep(tmp_path: Path) -> None:
    home = {"PREFECT_HOME": str(tmp_path / "prefect"), "GITHUB_TOKEN": "x"}
    out = init("--repo", "acme/gpu-ci", env=home)
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert "PREFECT_API_URL is not set" in out.stderr and "vanish" in out.stderr
    # no token on the command line, where ps and the shell's history would see it
    out = init("--repo", "acme/gpu-ci", "--token", "ghp_x", env=home)
    assert out.returncode == 2 and "No such option" in out.stderr
    out = init("--repo", "acme/gpu-ci", "--node-slot-scheduler", env=home)
    assert out.returncode == 2 and "add --priority-scheduler" in out.stderr
    # no GITHUB_TOKEN and no terminal to prompt on
    out = init(
        "--repo",
        "acme/gpu-ci",
        env={**home, "GITHUB_TOKEN": "", "PREFECT_API_URL": "http://127.0.0.1:9/api"},
    )
    assert out.returncode == 2 and "GITHUB_TOKEN is empty" in out.stderr, out.stderr


@pytest.mark.prefect_server
def test_init_saves_the_blocks_a_worker_loads(tmp_path: Path) -> None:
    with (
        running_prefect_server(tmp_path / "server") as server,
        running_emulator({"h100": 4}, token="sekrit") as emu,
    ):
        env = {"PREFECT_API_URL": server.api_url, "PREFECT_HOME": str(tmp_path / "client")}
        wrong = init(
            "--repo", "nobody/nothing", "--api-url", emu.url, env={**env, "GITHUB_TOKEN": "sekrit"}
        )
        assert wrong.returncode == 1 and len(wrong.stderr.splitlines()) == 1, wrong.stderr
        assert "GitHub answered 404 for GET /repos/nobody/nothing/actions/runners" in wrong.stderr

        flags = ["--priority-scheduler", "--node-slot-scheduler"]
        out = init(
            "--repo", emu.repo, "--api-url", emu.url, *flags, env={**env, "GITHUB_TOKEN": "sekrit"}
        )  # fmt: skip
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert out.stdout.startswith("saved slurmgate-github-scope/default (repo acme/gpu-ci")
        assert "sekrit" not in out.stdout

        job = emu.admin.add_job(["self-hosted", "cluster:h100", "nodes:3"], 600)["id"]
        # the flags in the environment say off: the policy block's say on, and win
        worker = run(
            [sys.executable, "-c", WORKER_TICK],
            {**env, "PRIORITY_SCHEDULER_ENABLED": "false", "NODE_SLOT_SCHEDULER_ENABLED": "false"},
        )
        assert worker.returncode == 0, worker.stderr[-3000:]
        result = json.loads(worker.stdout.strip().splitlines()[-1])
        assert result["summary"]["admitted"] == 1, result
        leased = [r for r in emu.admin.dump()["runners"] if any(
            lb["name"].startswith("ci-lease-") for lb in r["labels"])]  # fmt: skip
        assert len(leased) == 3, f"job {job} should hold 3 runners"
        assert "slurmgate init --repo OWNER/NAME --name missing" in result["missing"]
        assert "prefect block register -m blocks" in result["missing"]

        # a cordon lives in the saved policy block: the next tick admits nothing to the pool,
        # and one command undoes it
        cordon = run([*SLURMGATE, "cordon", "h100", "--reason", "PSU swap"], env)
        assert cordon.returncode == 0, cordon.stderr
        assert cordon.stdout.strip() == "cordoned cluster:h100 (PSU swap)"
        second = emu.admin.add_job(["self-hosted", "cluster:h100", "nodes:1"], 600)["id"]
        cordoned = run([sys.executable, "-c", CORDONED_TICKS], env)
        assert cordoned.returncode == 0, cordoned.stderr[-3000:]
        while_cordoned, uncordon, reopened = json.loads(cordoned.stdout.strip().splitlines()[-1])
        assert (while_cordoned["admitted"], while_cordoned["blocked"]) == (0, 1)
        assert uncordon == "uncordoned h100; cordoned pools now: none"
        assert reopened["admitted"] == 1
        assert emu.job_placement(second)[0] == "in_progress"
        missing = run([*SLURMGATE, "cordon", "h100", "--name", "nope"], env)
        assert missing.returncode == 2 and "slurmgate init --name nope" in missing.stderr


def test_the_token_is_asked_for_hidden_on_a_terminal(tmp_path: Path) -> None:
    """No GITHUB_TOKEN: init asks on the terminal without echo; the typed token reaches GitHub
    (the emulator accepts only it), and the command stops at the next step, an absent API."""
    with running_emulator({"h100": 1}, token="typed-sekrit") as emu:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.pop("GITHUB_TOKEN", None)
        env.update(PREFECT_HOME=str(tmp_path), PREFECT_API_URL="http://127.0.0.1:9/api")
        argv = [*SLURMGATE, "init", "--repo", emu.repo, "--api-url", emu.url]
        pid, fd = pty.fork()
        if pid == 0:  # the child: a new session whose terminal is the pty
            os.chdir(REPO)
            os.execve(sys.executable, argv, env)
        seen = b""
        answered = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            # answer once getpass has turned echo off: it writes the prompt's last space after
            if not answered and seen.endswith(b"GitHub token (input hidden): "):
                os.write(fd, b"typed-sekrit\n")
                answered = True
        else:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        text = seen.decode(errors="replace")
        assert answered, text
        assert "typed-sekrit" not in text  # never echoed
        assert os.waitstatus_to_exitcode(status) == 1, text
        assert "the Prefect API at http://127.0.0.1:9/api does not answer" in text, text


def test_init_options_mirror_the_settings_model() -> None:
    """The policy names, defaults and help of `init` come from AdmissionSettings, not a copy."""
    import inspect
    from typing import get_args, get_type_hints

    from slurmgate.cli.init import init
    from slurmgate.settings.admission import AdmissionSettings, PolicyName

    hints = get_type_hints(init, include_extras=True)
    parameters = inspect.signature(init).parameters
    fields = AdmissionSettings.model_fields
    policy_type, policy_option = get_args(hints["policy"])
    assert policy_type == PolicyName and parameters["policy"].default == fields["policy"].default
    assert policy_option.help.rstrip(".") in str(fields["policy"].description)
    (_, timeout_option) = get_args(hints["timeout_min"])
    assert f"Default {fields['timeout_min'].default:g}" in timeout_option.help
    (_, flag) = get_args(hints["priority_scheduler"])
    first = str(fields["PRIORITY_SCHEDULER_ENABLED"].description).split(". ")[0]
    assert first.rstrip(".") in flag.help
