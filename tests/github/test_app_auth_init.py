"""`slurmgate init` with a GitHub App: the key comes from a file or the environment, never argv;
the saved scope block makes a worker's tick authenticate as the App."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmgate.github.app_auth import APP_ID_ENV, APP_PRIVATE_KEY_ENV
from slurmgate.testbed.emulator.apps import new_private_key
from slurmgate.testbed.emulator.testing import running_emulator
from slurmgate.testbed.prefect_server import running_prefect_server

REPO = Path(__file__).resolve().parents[2]
SLURMGATE = [sys.executable, "-m", "slurmgate.cli"]
WORKER_TICK = """
import asyncio, json
from slurmgate.blocks import GitHubScopeBlock
from slurmgate.flows.reconcile import reconcile

block = GitHubScopeBlock.load("default")
summary = asyncio.run(reconcile(scope_block="default", policy_block="default",
                                reap_allocations=False))
print(json.dumps({"summary": summary, "app_id": block.app_id, "token": block.token is None}))
"""


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "SLURMGATE_GITHUB_APP_")) and k != "GITHUB_TOKEN"
    }
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**base, "DO_NOT_TRACK": "1", **env},
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_init_names_the_app_flag_that_is_missing_or_unreadable(tmp_path: Path) -> None:
    env = {"PREFECT_HOME": str(tmp_path / "p"), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    init = [*SLURMGATE, "init", "--repo", "acme/gpu-ci"]
    out = run([*init, "--app-id", "7", "--app-private-key-file", str(tmp_path / "none")], env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: --app-private-key-file ($SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE) names "
        f"'{tmp_path / 'none'}', which cannot be read (No such file or directory); give the "
        "path of the App's .pem private key file"
    ]
    key = tmp_path / "app.pem"
    key.write_text(new_private_key())
    out = run([*init, "--app-private-key-file", str(key)], env)
    assert out.returncode == 2 and "--app-id ($SLURMGATE_GITHUB_APP_ID) is empty" in out.stderr
    # the key itself is never an option: only its file's path is
    out = run([*init, "--app-id", "7", "--app-private-key", "x"], env)
    assert out.returncode == 2 and "No such option" in out.stderr


@pytest.mark.prefect_server
def test_init_saves_app_credentials_and_a_worker_ticks_as_the_app(tmp_path: Path) -> None:
    with (
        running_prefect_server(tmp_path / "server") as server,
        running_emulator({"h100": 4}, token="static-token-unused") as emu,
    ):
        app = emu.admin.create_app()
        key = tmp_path / "app.pem"
        key.write_text(app["private_key"])
        env = {"PREFECT_API_URL": server.api_url, "PREFECT_HOME": str(tmp_path / "client")}
        init = [*SLURMGATE, "init", "--repo", emu.repo, "--api-url", emu.url]
        flags = ["--priority-scheduler", "--node-slot-scheduler"]

        wrong = run(
            [*init, *flags],
            {**env, APP_ID_ENV: str(app["app_id"]), APP_PRIVATE_KEY_ENV: new_private_key()},
        )
        assert wrong.returncode == 1 and len(wrong.stderr.splitlines()) == 1, wrong.stderr
        assert f"GitHub App {app['app_id']}: GitHub refused the App's signed JWT" in wrong.stderr
        assert "(or pass --no-check to save anyway)" in wrong.stderr

        out = run(
            [*init, *flags, "--app-id", str(app["app_id"]), "--app-private-key-file", str(key)],
            env,
        )
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert out.stdout.startswith(
            f"saved slurmgate-github-scope/default (repo {emu.repo}, as GitHub App "
            f"{app['app_id']} on {emu.url})"
        )
        issued_by_init = emu.admin.app_stats()["tokens_issued"]
        assert issued_by_init == 1  # the access check

        job = emu.admin.add_job(["self-hosted", "cluster:h100", "nodes:3"], 600)["id"]
        worker = run([sys.executable, "-c", WORKER_TICK], env)
        assert worker.returncode == 0, worker.stderr[-3000:]
        result = json.loads(worker.stdout.strip().splitlines()[-1])
        assert result["summary"]["admitted"] == 1, result
        assert (result["app_id"], result["token"]) == (app["app_id"], True)
        assert emu.job_placement(job)[0] in ("queued", "in_progress")
        assert emu.admin.app_stats()["tokens_issued"] == issued_by_init + 1  # the worker's
        pem_body = "".join(line for line in app["private_key"].splitlines() if "-----" not in line)
        assert pem_body not in out.stdout + worker.stdout + worker.stderr


async def test_an_inline_scope_takes_the_app_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What `reconcile --once` and `deployments/serve.py --repo` hand the flow: no block, the
    App's variables in the environment (they win over a GITHUB_TOKEN that is also set)."""
    from slurmgate.tasks.github import resolve_scope

    with running_emulator({"h100": 3}, token="static-token") as emu:
        app = emu.admin.create_app()
        monkeypatch.setenv("GITHUB_TOKEN", "static-token")
        monkeypatch.setenv(APP_ID_ENV, str(app["app_id"]))
        monkeypatch.setenv(APP_PRIVATE_KEY_ENV, app["private_key"])
        monkeypatch.setenv("SLURMGATE_STATE_DIR", str(tmp_path))
        block = await resolve_scope(None, api_url=emu.url, repo=emu.repo)
        assert block.token is None and block.app_id == app["app_id"]
        async with block.get_client() as client:
            assert len(await client.list_runners()) == 3
        assert emu.admin.app_stats()["tokens_issued"] == 1
