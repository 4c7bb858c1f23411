"""The model directory a stand-in loads: its command's, or a tiny one the controller writes."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import slurmgate
from slurmgate.runtime.engines import mocker, vllm_cpu
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.spec.deployment import DeploymentSpec
from slurmgate.settings import handed

TINY_MODEL_MODULE = "slurmgate.testbed.tiny_hf"


@dataclass(frozen=True)
class TinyModel:
    """How a stand-in's tiny model is written: where in the run's directory, with which of
    tiny_hf's flags, how long it may take; the flag a command names its own model with, and
    the venv whose python writes it."""

    directory: str
    flags: tuple[str, ...]
    timeout_s: float
    what: str
    own_flag: str
    venv: str


TINY_MODELS = {
    # config and tokenizer only: `tokenizers` is in the Dynamo venv
    "dynamo-mocker": TinyModel("mocker-model", (), 60.0, "the mocker's", "--model-path", "Dynamo"),
    # random weights too: torch and safetensors are in the vLLM venv, and importing torch on a
    # busy machine takes a while
    "vllm-cpu": TinyModel("vllm-model", ("--weights",), 300.0, "vLLM's", "--model", "vLLM"),
}


def model_dir(ctx: RunContext, dspec: DeploymentSpec) -> str | None:
    """Where the deployment's stand-in lanes read their model (None: no stand-in): the
    command's own (the mocker's --model-path, vLLM's --model), else a tiny directory in the
    run's directory, written once by the controller with the command's Python (the Dynamo
    venv's, which has `tokenizers`; for vllm-cpu the vLLM venv's, which also has torch for
    the random weights). Preflight then checks it is readable on every node, like any model
    path: the run's directory must then be on a filesystem the nodes share."""
    if dspec.stand_in is None:
        return None
    tiny = TINY_MODELS[dspec.stand_in]
    if dspec.stand_in == "vllm-cpu":
        given = vllm_cpu.command_model_dir(dspec.command)
    else:
        given = mocker.command_model_dir(dspec.command)
    if given is not None:
        return given
    where = (ctx.run_dir / tiny.directory).resolve()
    if (where / "config.json").is_file():
        return str(where)
    if dspec.stand_in == "vllm-cpu":
        python = vllm_cpu.command_python(dspec.command)
    else:
        python = mocker.command_python(dspec.command)
    # the module is this package's, which the stand-in's venv need not have installed
    root = str(Path(slurmgate.__file__).resolve().parents[1])
    env = handed.inherited()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    ctx.log(f"decision: write {tiny.what} tiny model directory {where} with {python}")
    try:
        done = subprocess.run(
            [python, "-m", TINY_MODEL_MODULE, *tiny.flags, str(where)],
            env=env,
            capture_output=True,
            text=True,
            timeout=tiny.timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunFailed(
            ctx.phase,
            f"deployment {dspec.name}: command: cannot write {tiny.what} model: {exc}",
        ) from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise RunFailed(
            ctx.phase,
            f"deployment {dspec.name}: command: {python} could not write {tiny.what} model "
            f"({' '.join(tail)}); give {tiny.own_flag} DIR or the {tiny.venv} venv's python",
        )
    return str(where)
