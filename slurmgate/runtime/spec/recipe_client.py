"""The client command of a recipe-built spec: the recipe's benchmark tool, else a smoke load.

sa-bench recipes run `slurmgate bench sa-bench` (srt-slurm's client, as its bench.sh runs it);
`type: custom` rows that run InferenceX's agentic_srt.sh run `slurmgate bench aiperf` (AIPerf's
trace replay as that script runs it, or the script itself where InferenceX's workspace is
mounted). What neither covers gets `slurmgate loadgen --chat` at the recipe's lengths, and the
report says why.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

SA_BENCH_REPORTED = (
    "run as the client: slurmgate bench sa-bench, srt-slurm's sa-bench client as its bench.sh "
    "runs it, at the recipe's ISL, OSL and concurrencies with the model's tokenizer"
)
AGENTIC_SCRIPT = "agentic_srt.sh"  # InferenceX's benchmarks/multi_node/agentic_srt.sh
AGENTIC_REPORTED = (
    "run as the client: slurmgate bench aiperf, AIPerf's agentic replay as InferenceX's "
    "agentic_srt.sh runs it (the recipe's command as written where its workspace is mounted)"
)
SMOKE = "the client sends a short slurmgate loadgen --chat smoke load"
# The tool starts at the endpoint the client step is handed ($OPENAI_BASE_URL ends in /v1).
_BENCH = 'exec python -m slurmgate.cli bench {tool} "${{OPENAI_BASE_URL%/v1}}" {args}'


def client_command(
    r: Mapping[str, Any], served: str, tokenizer: str, conc: str | None = None
) -> tuple[list[str], str]:
    """The recipe's own benchmark tool when slurmgate runs it (`slurmgate bench`), else a
    `slurmgate loadgen --chat` smoke load; and how the benchmark runs, for the report.

    `conc` is the job-mix row's concurrencies (InferenceX's CONC_LIST, `4x8`), which an agentic
    recipe without its own takes, as InferenceX hands them to its script."""
    bench = r.get("benchmark") or {}
    if not isinstance(bench, dict):
        bench = {}
    given = bench.get("env")
    env: dict[str, Any] = given if isinstance(given, dict) else {}
    if conc and not (env.get("CONC_LIST") or env.get("CONC")):
        bench = {**bench, "env": {**env, "CONC_LIST": " ".join(concurrency_words(conc))}}
    kind = bench.get("type")
    if kind == "sa-bench":
        why_not = _sa_bench_unsupported(bench)
        if why_not is None:
            return _sa_bench(r, bench, served, tokenizer), SA_BENCH_REPORTED
    elif kind == "custom" and AGENTIC_SCRIPT in str(bench.get("command", "")):
        why_not = _agentic_unsupported(bench)
        if why_not is None:
            return _agentic(bench, served, tokenizer), AGENTIC_REPORTED
    else:
        why_not = (
            f"type {kind!r} runs srt-slurm's harness in its container; slurmgate runs "
            "sa-bench and InferenceX's agentic AIPerf replay only"
        )
    return _loadgen(bench, served), f"{why_not}; {SMOKE}"


def concurrency_words(conc: str) -> list[str]:
    """`4x8`, `4 8` or `4,8` as the concurrencies' words; ValueError names a bad one."""
    words = [w for w in conc.replace("x", " ").replace(",", " ").split() if w]
    if not words or len(words) > 32 or not all(w.isascii() and w.isdigit() and int(w) > 0
                                               for w in words):  # fmt: skip
        raise ValueError(f"{conc!r} is not a list of positive concurrencies (4x8)")
    return words


def _sa_bench_unsupported(bench: Mapping[str, Any]) -> str | None:
    if (bench.get("dataset_name") or "random") != "random":
        return f"sa-bench dataset_name {bench.get('dataset_name')!r} reads a container's file"
    if bench.get("isl") is None or bench.get("osl") is None:
        return "sa-bench without isl and osl"
    try:
        concurrencies(bench.get("concurrencies"))
    except (TypeError, ValueError):
        return f"sa-bench concurrencies {bench.get('concurrencies')!r} are not counts"
    return None


def concurrencies(raw: Any) -> list[int]:
    """srt-slurm's concurrencies: `4x8x16`, a list, or one count."""
    items = raw.split("x") if isinstance(raw, str) else raw if isinstance(raw, list) else [raw]
    found = [int(c) for c in items if str(c).strip()]
    if not found or min(found) < 1:
        raise ValueError(raw)
    return found


def gpus(r: Mapping[str, Any]) -> tuple[bool, int, int, int]:
    """srt-slurm's GPU counts for sa-bench's result file name: (disaggregated, total, prefill,
    decode), as its ResourceConfig computes them."""
    res = r.get("resources") or {}
    gpn = int(res.get("gpus_per_node") or 4)
    if res.get("prefill_nodes") is None and res.get("decode_nodes") is None:
        return False, int(res.get("agg_nodes") or 1) * gpn, 0, 0

    def per(role: str) -> int:
        explicit = res.get(f"gpus_per_{role}")
        if explicit is not None:
            return int(explicit)
        nodes, workers = res.get(f"{role}_nodes"), res.get(f"{role}_workers")
        if nodes and workers:
            return int(nodes) * gpn // int(workers)
        if role == "decode" and nodes == 0 and workers:
            return per("prefill")
        return gpn

    prefill = int(res.get("prefill_workers") or 0) * per("prefill")
    decode = int(res.get("decode_workers") or 0) * per("decode")
    return True, prefill + decode, prefill, decode


def _sa_bench(r: Mapping[str, Any], bench: Mapping[str, Any], served: str, tok: str) -> list[str]:
    disagg, total, prefill, decode = gpus(r)
    levels = "x".join(str(c) for c in concurrencies(bench.get("concurrencies")))
    args = ["--model", served, "--tokenizer", tok, "--isl", str(int(bench["isl"]))]
    args += ["--osl", str(int(bench["osl"])), "--concurrencies", levels]
    args += ["--req-rate", str(bench.get("req_rate") or "inf")]
    for key in ("random_range_ratio", "num_prompts_mult", "num_warmup_mult", "custom_tokenizer"):
        if bench.get(key) is not None:
            args += [f"--{key.replace('_', '-')}", str(bench[key])]
    if bench.get("use_chat_template") is False:
        args.append("--no-chat-template")
    args += ["--gpus", str(total)]
    if disagg:
        args += ["--disaggregated", "--prefill-gpus", str(prefill), "--decode-gpus", str(decode)]
    return ["sh", "-c", _BENCH.format(tool="sa-bench", args=shlex.join(args))]


def _agentic_unsupported(bench: Mapping[str, Any]) -> str | None:
    env = bench.get("env") or {}
    if not isinstance(env, dict) or not (env.get("CONC_LIST") or env.get("CONC")):
        return (
            "the agentic replay's concurrencies (CONC_LIST or CONC) come from InferenceX's "
            "matrix, not this recipe"
        )
    return None


def _agentic(bench: Mapping[str, Any], served: str, tokenizer: str) -> list[str]:
    env = {str(k): str(v) for k, v in (bench.get("env") or {}).items()}
    levels = "x".join((env.get("CONC_LIST") or env["CONC"]).split())
    args = ["--model", env.get("SERVED_MODEL_NAME", served), "--tokenizer", tokenizer]
    args += ["--concurrencies", levels]
    if env.get("DURATION"):
        args += ["--duration", env["DURATION"]]
    if env.get("MODEL_PREFIX"):
        args += ["--model-prefix", env["MODEL_PREFIX"]]
    if env.get("MAX_MODEL_LEN") not in (None, "", "0"):
        args += ["--max-context-length", env["MAX_MODEL_LEN"]]
    for name in sorted(env):
        # AIPerf's and the corpus's settings; a key stays out of argv (the client's env has it)
        if name.startswith(("AIPERF_", "WEKA_", "HF_")) and "KEY" not in name:
            args += ["--env", f"{name}={env[name]}"]
    args += ["--recipe-command", str(bench["command"])]
    return ["sh", "-c", _BENCH.format(tool="aiperf", args=shlex.join(args))]


def _loadgen(bench: Mapping[str, Any], served: str) -> list[str]:
    isl, osl = bench.get("isl", 128), bench.get("osl", 128)
    raw = bench.get("concurrencies", [4]) if bench.get("type") == "sa-bench" else [2]
    if isinstance(raw, str):
        raw = [c for c in raw.split("x") if c]
    levels = [int(c) for c in (raw if isinstance(raw, list) else [raw])][:16] or [4]
    mult = int(bench.get("num_prompts_mult", 10)) if bench.get("type") == "sa-bench" else 5
    loops = " ".join(str(c) for c in levels)
    script = (
        f'for c in {loops}; do python -m slurmgate.cli loadgen "${{OPENAI_BASE_URL%/v1}}" '
        f"--chat --model {shlex.quote(served)} --concurrency $c --requests $((c * {mult})) "
        f"--prompt-tokens {int(isl)} --output-tokens {int(osl)} || exit 1; done"
    )
    return ["sh", "-c", script]
