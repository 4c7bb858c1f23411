"""Start and stop the bundled local Slurm cluster (`slurmgate cluster up|down`), idempotently."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slurmgate.errors import ExternalError
from slurmgate.settings.handed import inherited
from slurmgate.settings.testbed import LocalClusterSettings
from slurmgate.slurm.config import (
    BundledCluster,
    forget_cluster,
    load_cluster,
    save_cluster,
)

DEFAULT_DIR = "/tmp/slurm-local"
DEFAULT_MODE = "netns"  # one IP per node: lanes on different nodes may share a port
# What start.sh says when the same cluster is already up and it changed nothing.
ALREADY_RUNNING = "already running"


class ClusterError(ExternalError):
    """The local cluster could not be started or stopped; the message says why and what to do."""


@dataclass(frozen=True)
class ClusterEnv:
    """What a shell needs to talk to the cluster, and whether `up` started it."""

    slurm_conf: str
    directory: str
    started: bool = True

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
    env = inherited()
    given = LocalClusterSettings.environ()
    env["SLURM_LOCAL_DIR"] = directory or given.get("SLURM_LOCAL_DIR", DEFAULT_DIR)
    env["SLURM_LOCAL_MODE"] = mode or given.get("SLURM_LOCAL_MODE", DEFAULT_MODE)
    return env


def _run_script(name: str, env: dict[str, str], timeout: float) -> str:
    """Run one of the bundled scripts; its output, or ClusterError with the tail of it."""
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
    return out.stdout + out.stderr


def up(
    directory: str | None = None,
    mode: str | None = None,
    timeout: float = 300,
    *,
    record: bool = False,
) -> ClusterEnv:
    """Start the cluster (a no-op when it is already up with the same config).

    With `record` (what `slurmgate cluster up` does) the cluster's slurm.conf is written to
    the state directory, where every Slurm call of ours finds it when SLURM_CONF is unset,
    with whether this call started it: `down(only_if_started=True)` stops only that one.
    """
    if os.geteuid() != 0:
        raise ClusterError("the local cluster needs root (mknod, namespaces) — run as root")
    env = _env(directory, mode)
    output = _run_script("start.sh", env, timeout)
    directory = env["SLURM_LOCAL_DIR"]
    slurm_conf = f"{directory}/etc/slurm.conf"
    started = ALREADY_RUNNING not in output
    if record:
        previous = load_cluster()
        # Up again on a cluster an earlier `up` started: it is still that one's to stop.
        if previous is not None and previous.slurm_conf == slurm_conf:
            started = started or previous.started_by_up
        save_cluster(
            BundledCluster(slurm_conf=slurm_conf, directory=directory, started_by_up=started)
        )
    return ClusterEnv(slurm_conf=slurm_conf, directory=directory, started=started)


@dataclass(frozen=True)
class DownResult:
    """What `down` did: stopped the cluster, or left it running and why."""

    stopped: bool
    directory: str
    reason: str = ""


def down(
    directory: str | None = None,
    timeout: float = 120,
    *,
    only_if_started: bool = False,
    forget: bool = False,
) -> DownResult:
    """Stop the cluster (safe when nothing runs); `forget` also removes the `up` record.

    With `only_if_started` it stops the cluster only when the record says `slurmgate cluster
    up` started it, so a walk-through of the README inside a test suite never stops the
    cluster the suite itself started.
    """
    recorded = load_cluster()
    if (
        directory is None
        and recorded is not None
        and LocalClusterSettings.text("local_dir") is None
    ):
        directory = recorded.directory  # the one `up` brought up, unless told otherwise
    env = _env(directory, None)
    directory = env["SLURM_LOCAL_DIR"]
    if forget:
        forget_cluster()
    if only_if_started:
        if recorded is None:
            return DownResult(False, directory, "`slurmgate cluster up` recorded no cluster")
        if not recorded.started_by_up:
            return DownResult(
                False, directory, "it was already running when `slurmgate cluster up` ran"
            )
    _run_script("stop.sh", env, timeout)
    return DownResult(True, directory)
