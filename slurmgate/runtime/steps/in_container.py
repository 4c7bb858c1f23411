"""A node worker in a container: what it is told, who it is there, and the setup script it runs.

The standard library only: it runs under the image's own Python. Slurm 22.05's OCI containers
(`srun --container`) hand the container the step's environment but not the task's variables
(SLURM_PROCID, SLURMD_NODENAME, CUDA_VISIBLE_DEVICES), so a task there names itself by its
node's hostname (the bundle keeps the node's UTS namespace) and its GPUs are the container's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from slurmgate.errors import InputError

MAX_PATHS = 80
SETUP_TAIL_LINES = 20


class ContainerSpecError(InputError):
    """The container part of a worker spec is malformed."""


@dataclass(frozen=True)
class ContainerNeeds:
    """The container a step's node workers run in, as the worker needs to know it."""

    runtime: str  # "pyxis" or "oci"
    # what preflight checks on each node's own filesystem: a file image, a bundle, mount sources
    host_paths: list[str] = field(default_factory=list)
    setup_script: str | None = None
    setup_timeout_s: float = 1800.0

    def to_json(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "host_paths": self.host_paths,
            "setup_script": self.setup_script,
            "setup_timeout_s": self.setup_timeout_s,
        }

    @classmethod
    def from_json(cls, data: Any) -> ContainerNeeds:
        keys = {"runtime", "host_paths", "setup_script", "setup_timeout_s"}
        if not isinstance(data, dict) or set(data) != keys:
            raise ContainerSpecError(f"container: expected keys {sorted(keys)}")
        paths = data["host_paths"]
        if (
            data["runtime"] not in ("pyxis", "oci")
            or not isinstance(paths, list)
            or len(paths) > MAX_PATHS
            or not all(isinstance(p, str) and p.startswith("/") for p in paths)
            or not isinstance(data["setup_script"], str | None)
            or not isinstance(data["setup_timeout_s"], int | float)
        ):
            raise ContainerSpecError("container: runtime, host_paths or setup_script malformed")
        return cls(
            runtime=data["runtime"],
            host_paths=list(paths),
            setup_script=data["setup_script"],
            setup_timeout_s=float(data["setup_timeout_s"]),
        )

    @property
    def without_task_variables(self) -> bool:
        """Slurm's OCI containers hand no task variables (SLURM_PROCID, the GPUs) inside."""
        return self.runtime == "oci"


def missing_host_path(needs: ContainerNeeds) -> str | None:
    """The first file image, bundle or mount source this node lacks, or None."""
    for path in needs.host_paths:
        if not os.path.exists(path):
            return path
    return None


def task_index(hosts: list[str], here: str) -> int | None:
    """This task's place in the step's plan, from its node: one task per node."""
    return hosts.index(here) if here in hosts else None


def container_gpus(gpus_per_node: int) -> str:
    """The GPUs a container shows, numbered from 0: the step holds every GPU of the node."""
    return ",".join(str(i) for i in range(gpus_per_node))


def run_setup_script(needs: ContainerNeeds, say: Any) -> str | None:
    """Run the setup script with bash, its output on our stderr (the step's log), line by
    line; None when it passed, else the reason."""
    script = needs.setup_script
    if not script:
        return None
    if not os.path.isfile(script):
        return f"{script} does not exist in the container"
    say(f"setup script {script}: running")
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", script],
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            stderr=sys.stderr,
            timeout=needs.setup_timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"{script} ran over {needs.setup_timeout_s:g} s"
    except OSError as exc:
        return f"{script} could not start: {exc.strerror}"
    if done.returncode != 0:
        return f"{script} exited with status {done.returncode}"
    say(f"setup script {script}: done in {time.monotonic() - t0:.1f} s")
    return None
