"""Result files in InferenceX's naming and format: the per-concurrency copy and its agg_ file."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmgate.errors import InputError
from slurmgate.runtime.results.raw import SaBenchOutput

# The names and rules below are InferenceX's, at SemiAnalysisAI/InferenceX 843c6254:
# .github/workflows/benchmark-multinode-tmpl.yml (steps "Launch multi-node job script" and
# "Process result"), runners/launch_b300-nv.sh (the copy of srt-slurm's files), and
# utils/process_result.py (the agg_ file). tests/results runs that script on our files.

# srt-slurm's sa-bench names its file by concurrency and GPU split (NVIDIA/srt-slurm c88ef731
# src/srtctl/benchmarks/scripts/sa-bench/bench.sh): _ctx_/_gen_ only when disaggregated.
SA_BENCH_FILE = re.compile(
    r"results_concurrency_(?P<conc>\d+)_gpus_(?P<gpus>\d+)(?:_ctx_(?P<ctx>\d+)_gen_(?P<gen>\d+))?\.json"
)
# 16 hex characters of the recipe fingerprint end the name when the workflow has one.
FINGERPRINT_CHARS = 16
_NAME_PART = re.compile(r"[A-Za-z0-9._+-]+")
_MAX_VALUE = 256


def _needed(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if value is None or value == "":
        raise InputError(f"{name} is not set; export it as InferenceX's workflow does")
    if len(value) > _MAX_VALUE or "\n" in value:
        raise InputError(f"{name} is {len(value)} characters or multi-line; give its short value")
    return value


def _name_part(env: Mapping[str, str], name: str, default: str | None = None) -> str:
    value = env.get(name) or default
    if value is None:
        value = _needed(env, name)
    if not _NAME_PART.fullmatch(value) or len(value) > _MAX_VALUE:
        raise InputError(
            f"{name}={value[:40]!r} cannot be part of a file name; use letters, digits, . _ + -"
        )
    return value


def _count(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    text = env.get(name) or default
    if text is None:
        text = _needed(env, name)
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{name}={text[:40]!r} is not a whole number; set it to one") from None
    if value < 0:
        raise InputError(f"{name}={value} is negative; set it to a count")
    return value


@dataclass(frozen=True)
class Role:
    """One role's parallelism as the workflow exports it (PREFILL_* or DECODE_*)."""

    num_workers: int
    tp: int
    ep: int
    dp_attn: str
    pp: int
    dcp: int
    pcp: int

    @classmethod
    def from_env(cls, env: Mapping[str, str], role: str) -> Role:
        pp, dcp, pcp = (_count(env, f"{role}_{n}_SIZE", "1") for n in ("PP", "DCP", "PCP"))
        if min(pp, dcp, pcp) <= 0:
            raise InputError(f"{role}_PP_SIZE, _DCP_SIZE and _PCP_SIZE must be positive")
        return cls(
            num_workers=_count(env, f"{role}_NUM_WORKERS"),
            tp=_count(env, f"{role}_TP"),
            ep=_count(env, f"{role}_EP"),
            dp_attn=_name_part(env, f"{role}_DP_ATTN"),
            pp=pp,
            dcp=dcp,
            pcp=pcp,
        )

    @property
    def gpus(self) -> int:
        """GPUs of all the role's workers, as InferenceX's agentic aggregation counts them."""
        return self.num_workers * self.tp * self.pp * self.pcp

    def name(self, role: str) -> str:
        return (
            f"{role}-tp{self.tp}-pp{self.pp}-dcp{self.dcp}-pcp{self.pcp}-ep{self.ep}"
            f"-dp{self.dp_attn}-nw{self.num_workers}"
        )


@dataclass(frozen=True)
class RunShape:
    """One benchmark job's metadata: what InferenceX's multi-node workflow exports to the job
    and to process_result.py."""

    exp_name: str
    precision: str
    framework: str
    runner_type: str
    runner_name: str
    model_prefix: str
    image: str
    spec_decoding: str
    isl: int
    osl: int
    disagg: str
    concurrencies: tuple[int, ...]
    prefill: Role
    decode: Role
    recipe_fingerprint: str = ""
    prefill_hardware: str = ""
    decode_hardware: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RunShape:
        """The shape from InferenceX's variable names; a missing or bad one is named."""
        conc_text = _needed(env, "CONC_LIST")
        try:
            concurrencies = tuple(int(c) for c in conc_text.split())
        except ValueError:
            raise InputError(
                f"CONC_LIST={conc_text[:40]!r} is not space-separated whole numbers"
            ) from None
        if not concurrencies or min(concurrencies) <= 0:
            raise InputError("CONC_LIST holds no positive concurrency; list the sweep's")
        prefill_hw, decode_hw = env.get("PREFILL_HARDWARE", ""), env.get("DECODE_HARDWARE", "")
        if bool(prefill_hw) != bool(decode_hw):
            raise InputError("PREFILL_HARDWARE and DECODE_HARDWARE go together; set both or none")
        fingerprint = env.get("RECIPE_FINGERPRINT", "")
        if fingerprint and not re.fullmatch(r"[0-9a-fA-F]+", fingerprint):
            raise InputError("RECIPE_FINGERPRINT must be hexadecimal; give the recipe's digest")
        disagg = _needed(env, "DISAGG")
        if disagg.lower() not in ("true", "false"):
            raise InputError(f"DISAGG={disagg[:20]!r} must be true or false")
        return cls(
            exp_name=_name_part(env, "EXP_NAME"),
            precision=_name_part(env, "PRECISION"),
            framework=_name_part(env, "FRAMEWORK"),
            runner_type=_needed(env, "RUNNER_TYPE"),
            runner_name=_name_part(env, "RUNNER_NAME"),
            model_prefix=_needed(env, "MODEL_PREFIX"),
            image=_needed(env, "IMAGE"),
            spec_decoding=_name_part(env, "SPEC_DECODING"),
            isl=_count(env, "ISL"),
            osl=_count(env, "OSL"),
            disagg=disagg,
            concurrencies=concurrencies,
            prefill=Role.from_env(env, "PREFILL"),
            decode=Role.from_env(env, "DECODE"),
            recipe_fingerprint=fingerprint,
            prefill_hardware=prefill_hw,
            decode_hardware=decode_hw,
        )

    def result_filename(self) -> str:
        """RESULT_FILENAME as the workflow's launch step builds it."""
        conc = "x".join(str(c) for c in self.concurrencies)
        name = (
            f"{self.exp_name}_{self.precision}_{self.framework}_{self.prefill.name('prefill')}"
            f"_{self.decode.name('decode')}_disagg-{self.disagg}_spec-{self.spec_decoding}"
            f"_conc{conc}_{self.runner_name}"
        )
        if self.recipe_fingerprint:
            name += f"_recipe-{self.recipe_fingerprint[:FINGERPRINT_CHARS]}"
        return name


@dataclass(frozen=True)
class GpuSplit:
    """A result file's GPUs: the total, and prefill's and decode's when disaggregated."""

    total: int
    prefill: int | None
    decode: int | None

    @classmethod
    def of(cls, shape: RunShape) -> GpuSplit:
        prefill, decode = shape.prefill.gpus, shape.decode.gpus
        return cls(prefill + decode, prefill, decode) if decode else cls(prefill, None, None)

    @classmethod
    def from_sa_bench_name(cls, name: str) -> GpuSplit | None:
        found = SA_BENCH_FILE.fullmatch(name)
        if found is None:
            return None
        ctx, gen = found["ctx"], found["gen"]
        return cls(int(found["gpus"]), int(ctx) if ctx else None, int(gen) if gen else None)

    def process_gpus(self) -> tuple[int, int]:
        """(PREFILL_GPUS, DECODE_GPUS) as the "Process result" step reads them from the name:
        without _ctx_/_gen_, every GPU is prefill's."""
        if self.prefill is None or self.decode is None:
            return self.total, 0
        return self.prefill, self.decode


def concurrency_filename(shape: RunShape, config_name: str, conc: int, split: GpuSplit) -> str:
    """The per-concurrency file name the launchers copy sa-bench's result to (no suffix)."""
    if not _NAME_PART.fullmatch(config_name):
        raise InputError(
            f"config name {config_name[:40]!r} cannot be part of a file name; use . _ + - too"
        )
    name = f"{shape.result_filename()}_{config_name}_conc{conc}_gpus_{split.total}"
    if split.prefill is not None and split.decode is not None:
        name += f"_ctx_{split.prefill}_gen_{split.decode}"
    return name


def process_env(shape: RunShape, result_filename: str, split: GpuSplit) -> dict[str, str]:
    """The environment InferenceX's "Process result" step gives process_result.py for one
    file: the job's variables, then RESULT_FILENAME, IS_MULTINODE and the GPU split."""
    prefill_gpus, decode_gpus = split.process_gpus()
    env = {
        "RUNNER_TYPE": shape.runner_type,
        "FRAMEWORK": shape.framework,
        "PRECISION": shape.precision,
        "SPEC_DECODING": shape.spec_decoding,
        "RESULT_FILENAME": result_filename,
        "ISL": str(shape.isl),
        "OSL": str(shape.osl),
        "DISAGG": shape.disagg,
        "MODEL_PREFIX": shape.model_prefix,
        "IMAGE": shape.image,
        "RECIPE_FINGERPRINT": shape.recipe_fingerprint,
        "IS_MULTINODE": "true",
        "PREFILL_GPUS": str(prefill_gpus),
        "DECODE_GPUS": str(decode_gpus),
    }
    for role, values in (("PREFILL", shape.prefill), ("DECODE", shape.decode)):
        env |= {
            f"{role}_NUM_WORKERS": str(values.num_workers),
            f"{role}_TP": str(values.tp),
            f"{role}_EP": str(values.ep),
            f"{role}_DP_ATTN": values.dp_attn,
            f"{role}_PP_SIZE": str(values.pp),
            f"{role}_DCP_SIZE": str(values.dcp),
            f"{role}_PCP_SIZE": str(values.pcp),
        }
    if shape.prefill_hardware:
        env |= {"PREFILL_HARDWARE": shape.prefill_hardware}
        env |= {"DECODE_HARDWARE": shape.decode_hardware}
    return env


def agg_record(
    shape: RunShape, raw: SaBenchOutput, latencies: Mapping[str, float], split: GpuSplit
) -> dict[str, Any]:
    """The agg_ body process_result.py writes for a multi-node result, power fields aside (they
    come from GPU counters slurmgate does not read)."""
    prefill_gpus, decode_gpus = split.process_gpus()
    total_gpus = prefill_gpus + decode_gpus
    if prefill_gpus <= 0:
        raise InputError("the result has no prefill GPU; check PREFILL_TP and the file's name")
    decoding = decode_gpus > 0
    data: dict[str, Any] = {
        "hw": shape.runner_type,
        "conc": raw.max_concurrency,
        "image": shape.image,
        "model": raw.model_id,
        "infmax_model_prefix": shape.model_prefix,
        "framework": shape.framework,
        "precision": shape.precision,
        "spec_decoding": shape.spec_decoding,
        "disagg": shape.disagg.lower() == "true",
        "recipe_fingerprint": shape.recipe_fingerprint,
        "isl": shape.isl,
        "osl": shape.osl,
        "is_multinode": True,
        "prefill_tp": shape.prefill.tp,
        "prefill_pp": shape.prefill.pp,
        "prefill_dcp_size": shape.prefill.dcp,
        "prefill_pcp_size": shape.prefill.pcp,
        "prefill_ep": shape.prefill.ep,
        "prefill_dp_attention": shape.prefill.dp_attn,
        "prefill_num_workers": shape.prefill.num_workers,
        "decode_tp": shape.decode.tp if decoding else 0,
        "decode_pp": shape.decode.pp if decoding else 1,
        "decode_dcp_size": shape.decode.dcp if decoding else 1,
        "decode_pcp_size": shape.decode.pcp if decoding else 1,
        "decode_ep": shape.decode.ep if decoding else 0,
        "decode_dp_attention": shape.decode.dp_attn,
        "decode_num_workers": shape.decode.num_workers,
        "num_prefill_gpu": prefill_gpus,
        "num_decode_gpu": decode_gpus,
        "tput_per_gpu": raw.total_token_throughput / total_gpus,
        "output_tput_per_gpu": raw.output_throughput / (decode_gpus if decoding else total_gpus),
        "input_tput_per_gpu": (raw.total_token_throughput - raw.output_throughput) / prefill_gpus,
    }
    if shape.prefill_hardware:
        data |= {"prefill_hw": shape.prefill_hardware, "decode_hw": shape.decode_hardware}
    for key, value in latencies.items():
        data[key.replace("_ms", "")] = value / 1000.0
        if "tpot" in key:
            if value == 0:
                raise InputError(f"field {key} is 0: no request produced a second token")
            data[key.replace("_ms", "").replace("tpot", "intvty")] = 1000.0 / value
    return data


@dataclass(frozen=True)
class Written:
    """The two files of one concurrency: InferenceX's copy of the raw result and its agg_."""

    result: Path
    agg: Path


def _write_json(target: Path, body: Any) -> None:
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps(body, indent=2) + "\n")
    partial.replace(target)


def write_concurrency(
    raw_path: Path,
    raw: SaBenchOutput,
    latencies: Mapping[str, float],
    shape: RunShape,
    out_dir: Path,
    config_name: str,
) -> Written:
    """Write ``<RESULT_FILENAME>_<config>_conc<N>_gpus_...json`` (sa-bench's file, byte for
    byte) and its ``agg_`` beside it in ``out_dir``, as InferenceX's workflow would."""
    split = GpuSplit.from_sa_bench_name(raw_path.name) or GpuSplit.of(shape)
    name = concurrency_filename(shape, config_name, raw.max_concurrency, split)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = out_dir / f"{name}.json"
    agg = out_dir / f"agg_{name}.json"
    _write_json(agg, agg_record(shape, raw, latencies, split))
    partial = result.with_name(f".{result.name}.partial")
    partial.write_bytes(raw_path.read_bytes())
    partial.replace(result)
    return Written(result=result, agg=agg)
