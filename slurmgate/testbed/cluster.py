"""Start and stop the bundled local Slurm cluster (`slurmgate cluster up|down`), idempotently."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slurmgate.errors import ExternalError

DEFAULT_DIR = "/tmp/slurm-local"
DEFAULT_MODE = "netns"  # one IP per node: lanes on different nodes may share a port


class ClusterError(ExternalError):
    """The local cluster could not be started or stopped; the message says why and what to do."""


@dataclass(frozen=True)
class ClusterEnv:
    """What a shell needs to talk to the cluster."""

    slurm_conf: str
    directory: str

    def exports(self) -> str:
        return f"export SLURM_CONF={self.slurm_conf}"


def scripts_dir() -> Path:
    """The start/stop scripts: shipped package data first, else the repository's copy."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (
        package / "data" / "slurm-local",
        package.parent / "scripts" / "slurm-local",
    ):
        if (candidate / "start.sh").is_file() and (candidate / "stop.sh").is_file():
            return candidate
    raise ClusterError(
        "the slurm-local scripts are not installed: expected slurmgate/data/slurm-local or "
        "scripts/slurm-local — run from a checkout of the repository"
    )


def _env(directory: str | None, mode: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["SLURM_LOCAL_DIR"] = directory or env.get("SLURM_LOCAL_DIR", DEFAULT_DIR)
    env["SLURM_LOCAL_MODE"] = mode or env.get("SLURM_LOCAL_MODE", DEFAULT_MODE)
    return env


def _run_script(name: str, env: dict[str, str], timeout: float) -> None:
    """Run one of the bundled scripts; a failure raises with the tail of its output."""
    try:
        out = subprocess.run(
            ["bash", str(scripts_dir() / name)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{name} did not finish within {timeout:g} s") from None
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
        raise ClusterError(f"{name} failed (exit {out.returncode}):\n{tail}")


def up(directory: str | None = None, mode: str | None = None, timeout: float = 300) -> ClusterEnv:
    """Start the cluster (a no-op when it is already up with the same config)."""
    if os.geteuid() != 0:
        raise ClusterError("the local cluster needs root (mknod, namespaces) — run as root")
    env = _env(directory, mode)
    _run_script("start.sh", env, timeout)
    directory = env["SLURM_LOCAL_DIR"]
    return ClusterEnv(slurm_conf=f"{directory}/etc/slurm.conf", directory=directory)


def down(directory: str | None = None, timeout: float = 120) -> None:
    """Stop the cluster; safe when nothing runs."""
    _run_script("stop.sh", _env(directory, None), timeout)
