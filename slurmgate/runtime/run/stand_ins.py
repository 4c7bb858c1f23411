"""The model directory a dynamo-mocker stand-in loads: its command's, or a tiny one written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import slurmgate
from slurmgate.runtime.engines import mocker
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.spec.deployment import DeploymentSpec
from slurmgate.settings import handed

TINY_MODEL_DIR = "mocker-model"
TINY_MODEL_MODULE = "slurmgate.testbed.tiny_hf"
WRITE_TIMEOUT_S = 60.0


def model_dir(ctx: RunContext, dspec: DeploymentSpec) -> str | None:
    """Where the deployment's mocker lanes read their model (None: no stand-in): the
    command's --model-path, else a tiny directory in the run's directory, written once by
    the controller with the command's Python (the Dynamo venv's, which has `tokenizers`).
    Preflight then checks it is readable on every node, like any model path: the run's
    directory must then be on a filesystem the nodes share."""
    if dspec.stand_in != "dynamo-mocker":
        return None
    given = mocker.command_model_dir(dspec.command)
    if given is not None:
        return given
    where = (ctx.run_dir / TINY_MODEL_DIR).resolve()
    if (where / "config.json").is_file():
        return str(where)
    python = mocker.command_python(dspec.command)
    # the module is this package's, which the Dynamo venv need not have installed
    root = str(Path(slurmgate.__file__).resolve().parents[1])
    env = handed.inherited()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    ctx.log(f"decision: write the mocker's tiny model directory {where} with {python}")
    try:
        done = subprocess.run(
            [python, "-m", TINY_MODEL_MODULE, str(where)],
            env=env,
            capture_output=True,
            text=True,
            timeout=WRITE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunFailed(
            ctx.phase, f"deployment {dspec.name}: command: cannot write the mocker's model: {exc}"
        ) from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise RunFailed(
            ctx.phase,
            f"deployment {dspec.name}: command: {python} could not write the mocker's model "
            f"({' '.join(tail)}); give --model-path DIR or the Dynamo venv's python",
        )
    return str(where)
