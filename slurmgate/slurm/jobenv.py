"""What Slurm sets in the environment of the processes it starts: the job, the task, the node.

The standard library only: the node worker reads its task and node here on every node. It also
holds the environment our Slurm commands run with, since SLURM_CONF is theirs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def slurm_variable(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """One of Slurm's variables (SLURM_JOB_ID, SLURM_PROCID, SLURMD_NODENAME, SLURM_CONF...),
    from this process's environment or from `env`."""
    return (os.environ if env is None else env).get(name)


def command_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: this process's environment) for a Slurm command to run in."""
    return dict(os.environ if base is None else base)
