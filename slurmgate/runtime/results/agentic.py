"""InferenceX's agentic aggregate, `<RESULT_FILENAME>_conc<N>.json`, from AIPerf's own exports.

A port of InferenceX's utils/agentic/aggregation/process_agentic_result.py and
request_metrics.py (commit 843c6254; tests/results runs them on the same artifacts and compares):
the measured requests of AIPerf's per-request export (warmup and failed ones counted, not
measured) give the QPS, latency, token and throughput statistics, the aggregate export the
dataset and theoretical cache hit rate, the server-metrics export the engines' cache and KV
figures. The name is the multi-node workflow's: agentic_srt.sh runs each concurrency with
RESULT_FILENAME=<RESULT_FILENAME>_conc<N>, and the workflow requires one such file per
concurrency (no agg_ prefix: that is the fixed-sequence-length file's). Expected output lengths
come, as in InferenceX's trace_metadata.py, from the Weka corpus in the Hugging Face cache, where
`slurmgate bench aiperf` fetched it; without it they are left empty, as InferenceX leaves them.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmgate.errors import InputError
from slurmgate.runtime.results.inferencex import RunShape
from slurmgate.runtime.results.raw import (
    AiperfExport,
    AiperfRecord,
    MetricValue,
    read_aiperf,
    read_aiperf_records,
    read_server_metrics,
)
from slurmgate.runtime.results.server_metrics import server_metrics

RECORDS_FILE = "profile_export.jsonl"
AGGREGATE_FILE = "profile_export_aiperf.json"
SERVER_METRICS_FILE = "server_metrics_export.json"
QPS_WINDOW_S = 1.0
ROUND_PLACES = 5  # InferenceX rounds every float of the file to this
STATS = ("mean", "p50", "p75", "p90", "p95")
# The hub datasets of InferenceX's Weka corpora (semianalysisai/cc-traces-weka-*), as the hub
# cache names their folders
WEKA_DATASETS = "semianalysisai--cc-traces-weka"
MAX_TRACE_BYTES = 256 * 1024 * 1024  # one trace of the corpus; a larger file is not one


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes", "on")


def _metadata(
    env: Mapping[str, str], name: str, keys: set[frozenset[str]]
) -> dict[str, str] | None:
    """An optional ``{"name": .., "version": ..}`` variable, checked as InferenceX checks it;
    ``keys`` are the key sets allowed."""
    text = env.get(name, "")
    if text in ("", "null"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise InputError(f'{name} must hold JSON like {{"name": "x", "version": "1"}}') from None
    if not isinstance(value, dict) or frozenset(value) not in keys:
        raise InputError(f"{name} must hold 'name' and 'version' keys (as InferenceX allows)")
    if not all(isinstance(v, str) and v for v in value.values()):
        raise InputError(f"{name}: its name and version must be non-empty strings")
    return value


@dataclass(frozen=True)
class AgenticJob:
    """The job variables the agentic aggregate carries beyond the run's shape."""

    shape: RunShape
    model: str
    kv_offloading: str
    kv_offload_backend: dict[str, str] | None
    router: dict[str, str] | None
    kv_p2p_transfer: str
    total_cpu_dram_gb: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgenticJob:
        """InferenceX's multi-node agentic variables; a missing or bad one is named."""
        shape = RunShape.from_env(env)
        offloading = env.get("KV_OFFLOADING", "")
        if not offloading:
            raise InputError("KV_OFFLOADING is not set; export it (none, or the offload mode)")
        backend_name = env.get("KV_OFFLOAD_BACKEND", "")
        allowed = {frozenset({"name"}), frozenset({"name", "version"})}
        backend = _metadata(env, "KV_OFFLOAD_BACKEND_METADATA", allowed)
        if offloading == "none" and (backend_name or backend is not None):
            raise InputError("KV_OFFLOAD_BACKEND must be empty when KV_OFFLOADING=none")
        if offloading != "none":
            if not backend_name or backend_name == "none" or backend is None:
                raise InputError(
                    "KV_OFFLOAD_BACKEND and KV_OFFLOAD_BACKEND_METADATA are needed when "
                    "KV_OFFLOADING is not none"
                )
            if backend["name"] != backend_name:
                raise InputError("KV_OFFLOAD_BACKEND must match KV_OFFLOAD_BACKEND_METADATA.name")
        dram = env.get("TOTAL_CPU_DRAM_GB") or "0"
        try:
            total_cpu_dram_gb = int(dram)
        except ValueError:
            raise InputError(f"TOTAL_CPU_DRAM_GB={dram[:20]!r} is not a whole number") from None
        return cls(
            shape=shape,
            model=env.get("MODEL", ""),
            kv_offloading=offloading,
            kv_offload_backend=backend,
            router=_metadata(env, "ROUTER_METADATA", {frozenset({"name", "version"})}),
            kv_p2p_transfer=env.get("KV_P2P_TRANSFER", ""),
            total_cpu_dram_gb=total_cpu_dram_gb,
        )

    def result_filename(self, concurrency: int) -> str:
        """RESULT_FILENAME as agentic_srt.sh sets it for one concurrency."""
        return f"{self.shape.result_filename()}_conc{concurrency}"


def percentile(data: Sequence[float], p: float) -> float:
    """Linear interpolation between the closest ranks, as InferenceX computes it."""
    if not data:
        return 0.0
    ordered = sorted(data)
    k = (len(ordered) - 1) * (p / 100)
    f = int(k)
    if f + 1 >= len(ordered):
        return ordered[f]
    return ordered[f] + (k - f) * (ordered[f + 1] - ordered[f])


def distribution(values: Sequence[float]) -> dict[str, float]:
    """mean, p50..p95 and the population std of ``values``; empty when there are none."""
    if not values:
        return {}
    out: dict[str, float] = {"mean": statistics.mean(values)}
    for p in (50, 75, 90, 95):
        out[f"p{p}"] = percentile([float(v) for v in values], p)
    out["std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    return out


def _float(value: MetricValue) -> float | None:
    if value is None or isinstance(value, list):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _int(value: MetricValue) -> int | None:
    if value is None or isinstance(value, list):
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):
        return None


def floats(records: Sequence[AiperfRecord], tag: str) -> list[float]:
    return [v for r in records if (v := _float(r.value(tag))) is not None]


def ints(records: Sequence[AiperfRecord], tag: str) -> list[int]:
    return [v for r in records if (v := _int(r.value(tag))) is not None]


def seconds(records: Sequence[AiperfRecord], tag: str) -> list[float]:
    """A latency of every measured request, ms to s; zero, negative and non-finite dropped."""
    return [v / 1000.0 for v in floats(records, tag) if math.isfinite(v) and v > 0]


def interactivity(latency: Mapping[str, float], values: Sequence[float]) -> dict[str, float]:
    """Tokens per second per user: 1 / each latency statistic, and the std of 1 / latency."""
    out = {k: 1.0 / v for k in STATS if (v := latency.get(k, 0.0)) > 0}
    per_request = [1.0 / v for v in values if v > 0]
    if per_request:
        out["std"] = statistics.pstdev(per_request) if len(per_request) > 1 else 0.0
    return out


def latency_stats(records: Sequence[AiperfRecord]) -> dict[str, dict[str, float]]:
    ttft = seconds(records, "time_to_first_token")
    e2el = seconds(records, "request_latency")
    itl = seconds(records, "inter_token_latency")
    full_itl = seconds(records, "full_response_inter_token_latency")
    per_token: list[float] = []  # each request's latency over its output length, in s
    for r in records:
        latency, osl = _float(r.value("request_latency")), _float(r.value("output_sequence_length"))
        if latency is None or osl is None or not math.isfinite(latency) or not math.isfinite(osl):
            continue
        if latency > 0 and osl > 0:
            per_token.append(latency / 1000.0 / osl)
    itl_stats, full_stats = distribution(itl), distribution(full_itl)
    return {
        "ttft": distribution(ttft),
        "e2el": distribution(e2el),
        "itl": itl_stats,
        "tpot": distribution(itl),
        "intvty": interactivity(itl_stats, itl),
        "e2e_norm_intvty": interactivity(distribution(per_token), per_token),
        "full_response_itl": full_stats,
        "full_response_intvty": interactivity(full_stats, full_itl),
    }


def qps_stats(records: Sequence[AiperfRecord]) -> dict[str, float]:
    """Completions per 1 s window from the first completion to the last."""
    ends = sorted(e / 1e9 for r in records if (e := r.metadata.request_end_ns))
    if len(ends) < 2 or ends[-1] - ends[0] <= 0:
        return {}
    counts: list[float] = []
    start = ends[0]
    while start + QPS_WINDOW_S <= ends[-1]:
        counts.append(sum(1 for t in ends if start <= t < start + QPS_WINDOW_S) / QPS_WINDOW_S)
        start += QPS_WINDOW_S
    found = distribution(counts) if counts else {"mean": len(ends) / (ends[-1] - ends[0])}
    return {"window_seconds": QPS_WINDOW_S, "samples": len(counts), **found}


def throughput_stats(records: Sequence[AiperfRecord]) -> dict[str, Any]:
    """Tokens per second over the span from the first request's start to the last one's end."""
    starts = [s for r in records if (s := r.metadata.request_start_ns)]
    ends = [e for r in records if (e := r.metadata.request_end_ns)]
    if not starts or not ends or (duration := (max(ends) - min(starts)) / 1e9) <= 0:
        return {}
    inputs = sum(ints(records, "input_sequence_length"))
    outputs = sum(ints(records, "output_sequence_length"))
    return {
        "input": {"tokens_per_second": inputs / duration},
        "output": {"tokens_per_second": outputs / duration},
        "total": {"tokens_per_second": (inputs + outputs) / duration},
        "duration_seconds": duration,
        "per_gpu": {},
    }


def theoretical_hit_rate(aggregate: AiperfExport | None) -> float | None:
    """aiperf's theoretical prefix-cache hit: hit blocks over blocks, else its average."""
    extra = (aggregate.model_extra or {}) if aggregate else {}
    metric = extra.get("theoretical_prefix_cache_hit")
    if not isinstance(metric, dict):
        return None
    hits, blocks, avg = (_json_number(metric.get(k)) for k in ("sum", "count", "avg"))
    if hits is not None and blocks is not None and blocks > 0:
        return hits / blocks
    if avg is None:
        return None
    return avg / 100.0 if str(metric.get("unit", "")).strip() == "%" else avg


def _json_number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache the hub client uses under ``env``."""
    found = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if found:
        return Path(found)
    home = env.get("HF_HOME")
    return Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub"


def _corpus_snapshot(cache: Path) -> Path | None:
    """The newest snapshot of a Weka trace corpus in the cache that holds trace files."""
    if not cache.is_dir():
        return None
    snapshots = [
        snap
        for dataset in cache.glob(f"datasets--{WEKA_DATASETS}*")
        if (root := dataset / "snapshots").is_dir()
        for snap in root.iterdir()
        if snap.is_dir()
    ]
    snapshots.sort(key=lambda snap: snap.stat().st_mtime, reverse=True)
    return next((s for s in snapshots if any(s.glob("*.jsonl")) or any(s.glob("*.json"))), None)


def _trace_blobs(folder: Path) -> list[object]:
    """Every trace of the folder: its .jsonl lines, then its .json files; an unreadable file,
    line or one larger than a trace is skipped, as InferenceX skips it."""
    blobs: list[object] = []
    for path in sorted(folder.glob("*.jsonl")):
        try:
            with path.open("rb") as handle:
                for line in handle:
                    if line.strip() and len(line) <= MAX_TRACE_BYTES:
                        try:
                            blobs.append(json.loads(line))
                        except ValueError:
                            continue
        except OSError:
            continue
    for path in sorted(folder.glob("*.json")):
        try:
            if path.stat().st_size <= MAX_TRACE_BYTES:
                blobs.append(json.loads(path.read_bytes()))
        except (OSError, ValueError):
            continue
    return blobs


def trace_output_lengths(env: Mapping[str, str]) -> dict[str, list[int]]:
    """{trace id: the output length of each of its requests} of the cached Weka corpus."""
    folder = _corpus_snapshot(hub_cache(env))
    found: dict[str, list[int]] = {}
    for blob in _trace_blobs(folder) if folder else []:
        if not isinstance(blob, dict) or not blob.get("id"):
            continue
        turns: list[int] = []
        requests = blob.get("requests")
        for request in requests if isinstance(requests, list) else []:
            if not isinstance(request, dict) or request.get("type") not in ("n", "s"):
                continue
            length = request.get("output_length")
            length = request.get("out") if length is None else length
            try:
                turns.append(int(length or 0))
            except (TypeError, ValueError):
                turns.append(0)
        if turns:
            found[str(blob["id"])] = turns
    return found


def expected_output_lengths(
    records: Sequence[AiperfRecord], traces: Mapping[str, list[int]]
) -> list[int]:
    """Each measured request's output length in its trace: the conversation id up to aiperf's
    ``::`` subagent suffix names the trace, the turn index the request."""
    expected = []
    for record in records:
        conversation, turn = record.metadata.conversation_id, record.metadata.turn_index
        if not conversation or turn is None:
            continue
        turns = traces.get(conversation.split("::", 1)[0])
        if turns and turn < len(turns):
            expected.append(turns[turn])
    return expected


def request_metrics(
    records: Sequence[AiperfRecord],
    aggregate: AiperfExport | None,
    traces: Mapping[str, list[int]],
) -> dict[str, Any]:
    """The aggregate's request_metrics block."""
    input_tokens = [float(v) for v in ints(records, "input_sequence_length")]
    output_tokens = [float(v) for v in ints(records, "output_sequence_length")]
    expected = [float(v) for v in expected_output_lengths(records, traces)] if traces else []
    return {
        "qps": qps_stats(records),
        "latency": latency_stats(records),
        "tokens": {
            "input": distribution(input_tokens),
            "output_actual": distribution(output_tokens),
            "output_expected": distribution(expected),
        },
        "throughput": throughput_stats(records),
        "cache": {"theoretical_cache_hit_rate": theoretical_hit_rate(aggregate)},
    }


def _error_category(error: AiperfRecord) -> str:
    """The first word of a failure, as InferenceX groups them: its type, else its message's
    text before the first colon."""
    found = error.error
    if found is None:
        return "unknown"
    if isinstance(found, str):
        message: object = found
    else:
        fields = {**(found.model_extra or {}), "type": found.type, "code": found.code}
        for key in ("type", "error_type", "code", "class", "status"):
            if fields.get(key) not in (None, ""):
                return str(fields[key])
        message = found.message or fields.get("error")
    if not message:
        return "unknown"
    first = str(message).strip().splitlines()[0]
    return (first.split(":", 1)[0] or "unknown")[:120]


def measured(records: Sequence[AiperfRecord]) -> tuple[list[AiperfRecord], dict[str, Any]]:
    """The profiled requests that succeeded, and the accounting of every request exported."""
    kept: list[AiperfRecord] = []
    categories: dict[str, int] = {}
    warmup = errors = 0
    for record in records:
        warmup += not record.profiled
        if record.failed:
            errors += 1
            category = _error_category(record)
            categories[category] = categories.get(category, 0) + 1
        elif record.profiled:
            kept.append(record)
    return kept, {
        "records_total": len(records),
        "records_profiled": len(kept),
        "records_dropped_total": len(records) - len(kept),
        "records_warmup_dropped": warmup,
        "records_error_dropped": errors,
        "error_categories": categories,
    }


def _gpu_fields(shape: RunShape) -> tuple[dict[str, Any], int, int, int]:
    """The multi-node parallelism fields, the GPU count, TP and EP: without decode GPUs (an
    aggregated run) decode's parallelism is dropped, as InferenceX drops it."""
    p, d = shape.prefill, shape.decode
    decoding = d.gpus > 0
    fields: dict[str, Any] = {
        "prefill_num_workers": p.num_workers,
        "prefill_tp": p.tp,
        "prefill_pp": p.pp,
        "prefill_dcp_size": p.dcp,
        "prefill_pcp_size": p.pcp,
        "prefill_ep": p.ep,
        "prefill_dp_attention": p.dp_attn,
        "num_prefill_gpu": p.gpus,
        "decode_num_workers": d.num_workers,
        "decode_tp": d.tp if decoding else 0,
        "decode_pp": d.pp if decoding else 1,
        "decode_dcp_size": d.dcp if decoding else 1,
        "decode_pcp_size": d.pcp if decoding else 1,
        "decode_ep": d.ep if decoding else 0,
        "decode_dp_attention": d.dp_attn,
        "num_decode_gpu": d.gpus,
    }
    if shape.prefill_hardware:
        fields |= {"prefill_hw": shape.prefill_hardware, "decode_hw": shape.decode_hardware}
    return (
        fields,
        p.gpus + d.gpus,
        fields["prefill_tp"] + fields["decode_tp"],
        max(p.ep, fields["decode_ep"]),
    )


def round_floats(value: Any) -> Any:
    """Every finite float to 5 places, a whole one of 1 or more as an int, as InferenceX
    writes them."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return value
        rounded = round(value, ROUND_PLACES)
        return int(rounded) if abs(rounded) >= 1 and rounded.is_integer() else rounded
    if isinstance(value, dict):
        return {k: round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v) for v in value]
    return value


def agentic_record(
    job: AgenticJob,
    concurrency: int,
    records: Sequence[AiperfRecord],
    aggregate: AiperfExport | None,
    metrics: dict[str, Any],
    warnings: list[str],
    traces: Mapping[str, list[int]],
) -> dict[str, Any]:
    """The aggregate's body, before rounding, GPU power aside (InferenceX measures it in a
    step of its own, off for multi-node runs)."""
    shape = job.shape
    kept, accounting = measured(records)
    gpu_fields, gpus, tp, ep = _gpu_fields(shape)
    data: dict[str, Any] = {
        "hw": shape.runner_type,
        "conc": concurrency,
        "image": shape.image,
        "recipe_fingerprint": shape.recipe_fingerprint,
        "model": job.model,
        "infmax_model_prefix": shape.model_prefix,
        "framework": shape.framework,
        "precision": shape.precision,
        "spec_decoding": shape.spec_decoding,
        "disagg": _truthy(shape.disagg),
        "scenario_type": "agentic-coding",
        "is_multinode": True,
        "tp": tp,
        "ep": ep,
        "dp_attention": (
            "true" if _truthy(shape.prefill.dp_attn) or _truthy(shape.decode.dp_attn) else "false"
        ),
        "kv_offloading": job.kv_offloading,
        "kv_offload_backend": job.kv_offload_backend,
        "allocated_cpu_dram_gb": job.total_cpu_dram_gb,
        "num_requests_total": accounting["records_total"],
        "num_requests_successful": len(kept),
        "request_accounting": accounting,
        **gpu_fields,
    }
    if job.router is not None:
        data["router"] = job.router
    if job.kv_p2p_transfer:
        data["kv_p2p_transfer"] = job.kv_p2p_transfer
    dataset = ((aggregate.model_extra or {}) if aggregate else {}).get("metadata")
    if isinstance(dataset, dict) and isinstance(dataset.get("dataset"), dict):
        data["dataset"] = dataset["dataset"]
    requests = request_metrics(kept, aggregate, traces)
    total = requests["throughput"].get("total")
    if total is not None and gpus > 0:
        requests["throughput"]["per_gpu"] = {
            f"{kind}_tput_tps": requests["throughput"][kind]["tokens_per_second"] / gpus
            for kind in ("total", "output", "input")
        }
    data["request_metrics"] = requests
    data["server_metrics"] = metrics
    data["kv_cache_pool_tokens"] = metrics["kv_cache"]["gpu_total_tokens"]
    if warnings:
        data["warnings"] = warnings
    return data


def write_agentic(
    artifacts: Path,
    job: AgenticJob,
    out_dir: Path,
    concurrency: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Read AIPerf's exports in ``artifacts`` (its --output-artifact-dir) and write the
    concurrency's aggregate in ``out_dir``; returns its path. The concurrency is the caller's,
    else the aggregate export's profiling phase's; ``env`` locates the hub cache."""
    records = read_aiperf_records(artifacts / RECORDS_FILE)
    aggregate_path = artifacts / AGGREGATE_FILE
    aggregate = read_aiperf(aggregate_path) if aggregate_path.exists() else None
    concurrency = concurrency or (aggregate.profiled_concurrency() if aggregate else None)
    if concurrency is None:
        raise InputError(f"{artifacts}: aiperf's exports name no concurrency; give the run's")
    kept, _ = measured(records)
    export = read_server_metrics(artifacts / SERVER_METRICS_FILE)
    metrics, warnings = server_metrics(export, job.shape.framework, kept)
    traces = trace_output_lengths(env or {})
    body = agentic_record(job, concurrency, records, aggregate, metrics, warnings, traces)
    body = round_floats(body)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{job.result_filename(concurrency)}.json"
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps(body, indent=2) + "\n")
    partial.replace(target)
    return target
