"""The engines' server metrics AIPerf scraped, normalized as InferenceX's agentic aggregate has it.

A port of InferenceX's utils/agentic/aggregation/server_metrics.py, backends/ and
aggregation_common.py (commit 843c6254; the scripts run in tests/results): one adapter per
engine family, picked by metric prefix (``vllm:``, ``sglang:``, ``atom:``/``atom_``,
``dynamo_``) or by a FRAMEWORK starting with ``dynamo``. The KV pool size InferenceX also reads
from a ``server.log`` beside the artifacts is not read: slurmgate keeps lane logs elsewhere, so
``kv_cache.gpu_total_tokens`` comes from SGLang's ``max_total_num_tokens`` metric alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from slurmgate.errors import InputError
from slurmgate.runtime.results.raw import AiperfRecord, ServerMetricSeries, ServerMetricsExport

Metrics = dict[str, list[ServerMetricSeries]]
SeriesFilter = Callable[[ServerMetricSeries], bool]
COUNTER_KEYS = ("total", "sum", "max", "avg")
GAUGE_KEYS = ("max", "avg", "total")


# The adapters' working values, every one None until an adapter sets it
FLAT_FIELDS = (
    "server_gpu_cache_hit_rate",
    "server_cpu_cache_hit_rate",
    "server_external_cache_hit_rate",
    "server_overall_cache_hit_rate",
    "gpu_kv_cache_usage_pct",
    "cpu_kv_cache_usage_pct",
    "total_prompt_tokens",
    "total_generation_tokens",
)


class UnknownBackend(InputError):
    """The export holds metrics, but of no engine InferenceX's aggregation knows."""


def rate(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return float(numerator) / float(denominator)


def normalize_fraction(value: float | None) -> float | None:
    """A gauge exported as 0..1 or 0..100, as a fraction."""
    if value is None:
        return None
    return value / 100.0 if value > 1.5 else value


def counter_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _names(names: str | Sequence[str]) -> Sequence[str]:
    return [names] if isinstance(names, str) else names


def series_of(metrics: Metrics, names: str | Sequence[str]) -> list[ServerMetricSeries]:
    return [s for name in _names(names) for s in metrics.get(name, [])]


def series_stat(series: ServerMetricSeries, keys: Sequence[str]) -> float | None:
    if series.stats is None:
        return None
    for key in keys:
        value = series.stats.get(key)
        if value is not None:
            return value
    return None


def _stats(
    metrics: Metrics, names: str | Sequence[str], keys: Sequence[str], keep: SeriesFilter | None
) -> list[float]:
    """Each kept series' first statistic of `keys` that it has."""
    return [
        v
        for s in series_of(metrics, names)
        if keep is None or keep(s)
        if (v := series_stat(s, keys)) is not None
    ]


def sum_stat(
    metrics: Metrics,
    names: str | Sequence[str],
    keys: Sequence[str] = COUNTER_KEYS,
    keep: SeriesFilter | None = None,
) -> float | None:
    values = _stats(metrics, names, keys, keep)
    return sum(values, 0.0) if values else None


def gauge_stat(
    metrics: Metrics,
    names: str | Sequence[str],
    keys: Sequence[str] = GAUGE_KEYS,
    combine: str = "max",
    keep: SeriesFilter | None = None,
) -> float | None:
    values = _stats(metrics, names, keys, keep)
    if not values:
        return None
    if combine == "avg":
        return statistics.mean(values)
    return max(values)


def label(series: ServerMetricSeries, key: str) -> str | None:
    value = (series.labels or {}).get(key)
    return None if value is None else str(value)


def sum_by_label(metrics: Metrics, name: str, key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in series_of(metrics, name):
        if s.labels is None or (found := label(s, key)) is None:
            continue
        if (value := series_stat(s, COUNTER_KEYS)) is not None:
            out[found] = out.get(found, 0.0) + value
    return out


def empty_server_metrics(present: bool, metric_count: int) -> dict[str, Any]:
    """The aggregate's server_metrics block before any adapter fills it."""
    return {
        "present": present,
        "adapter": "none",
        "metric_count": metric_count,
        "cache": {
            "gpu_cache_hit_rate": None,
            "cpu_cache_hit_rate": None,
            "external_cache_hit_rate": None,
            "overall_cache_hit_rate": None,
            "prefix_cache_hits": None,
            "prefix_cache_queries": None,
            "external_prefix_cache_hits": None,
            "external_prefix_cache_queries": None,
            "cached_tokens_by_source": {},
            "frontend_cache_hit_rate": None,
            "router_kv_hit_rate": None,
            "router_shared_cache_hit_rate": None,
            "frontend_cached_tokens": None,
            "frontend_input_tokens": None,
        },
        "kv_cache": {
            "gpu_usage_pct": None,
            "gpu_total_tokens": None,
            "cpu_usage_pct": None,
            "cpu_used_tokens": None,
            "cpu_total_tokens": None,
        },
        "kv_offload": {
            "bytes_gpu_to_cpu": None,
            "bytes_cpu_to_gpu": None,
            "time_gpu_to_cpu": None,
            "time_cpu_to_gpu": None,
            "bandwidth_gpu_to_cpu_bytes_per_second": None,
            "bandwidth_cpu_to_gpu_bytes_per_second": None,
        },
        "tokens": {
            "prompt_total": None,
            "generation_total": None,
            "requests_completed": None,
            "prompt_by_source": {
                "gpu_cache_hit": None,
                "cpu_or_external_cache_hit": None,
                "computed": None,
                "raw": {},
            },
        },
        "sources": [],
    }


def _vllm_source_id(series: ServerMetricSeries) -> str:
    component = label(series, "dynamo_component") or label(series, "component") or ""
    role = {"prefill": "prefill", "backend": "decode", "decode": "decode"}.get(component)
    if role is None:
        role = "router" if component in ("frontend", "router") else "combined"
    parts = [role]
    if series.endpoint_url:
        parts.append(series.endpoint_url)
    for key in ("worker_id", "dp_rank", "engine"):
        if (value := label(series, key)) is not None:
            parts.append(f"{key}={value}")
    return "|".join(parts)


_VLLM_SOURCE_METRICS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_by_source",
)
_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def _vllm_sources(metrics: Metrics) -> list[dict[str, Any]]:
    ids = {_vllm_source_id(s) for name in _VLLM_SOURCE_METRICS for s in series_of(metrics, name)}
    sources = []
    for source in sorted(i for i in ids if i):

        def keep(s: ServerMetricSeries, source: str = source) -> bool:
            return _vllm_source_id(s) == source

        hits = sum_stat(metrics, "vllm:prefix_cache_hits", keep=keep)
        queries = sum_stat(metrics, "vllm:prefix_cache_queries", keep=keep)
        sources.append(
            {
                "id": source,
                "role": source.split("|", 1)[0],
                "prompt_tokens": sum_stat(metrics, "vllm:prompt_tokens", keep=keep),
                "generation_tokens": sum_stat(metrics, "vllm:generation_tokens", keep=keep),
                "prefix_cache_hit_rate": rate(hits, queries),
                "gpu_kv_cache_usage_pct": normalize_fraction(
                    gauge_stat(metrics, _VLLM_USAGE, keep=keep)
                ),
            }
        )
    return sources


def _first_counter(metrics: Metrics, names: Sequence[str]) -> float | None:
    for name in names:
        if (value := sum_stat(metrics, name)) is not None:
            return value
    return None


def _populate_vllm(
    metrics: Metrics, flat: dict[str, Any], nested: dict[str, Any], dynamo: bool
) -> None:
    if dynamo:
        prompt = _first_counter(
            metrics, ["dynamo_frontend_input_sequence_tokens", "vllm:prompt_tokens"]
        )
        generation = _first_counter(
            metrics, ["dynamo_frontend_output_tokens", "vllm:generation_tokens"]
        )
    else:
        prompt = sum_stat(metrics, "vllm:prompt_tokens")
        generation = sum_stat(metrics, "vllm:generation_tokens")
    flat["total_prompt_tokens"] = counter_int(prompt)
    flat["total_generation_tokens"] = counter_int(generation)
    hits = sum_stat(metrics, "vllm:prefix_cache_hits")
    queries = sum_stat(metrics, "vllm:prefix_cache_queries")
    gpu_rate = rate(hits, queries)
    flat["server_gpu_cache_hit_rate"] = gpu_rate
    ext_hits = sum_stat(metrics, "vllm:external_prefix_cache_hits")
    ext_queries = sum_stat(metrics, "vllm:external_prefix_cache_queries")
    flat["server_external_cache_hit_rate"] = rate(ext_hits, ext_queries)
    flat["server_cpu_cache_hit_rate"] = flat["server_external_cache_hit_rate"]
    by_source = sum_by_label(metrics, "vllm:prompt_tokens_by_source", "source")
    if by_source:
        local = by_source.get("local_cache_hit")
        external = by_source.get("external_kv_transfer")
        total = sum(by_source.values())
        if total > 0:
            if local is not None:
                flat["server_gpu_cache_hit_rate"] = local / total
            if external is not None:
                flat["server_cpu_cache_hit_rate"] = external / total
                flat["server_external_cache_hit_rate"] = external / total
            flat["server_overall_cache_hit_rate"] = ((local or 0.0) + (external or 0.0)) / total
        nested["tokens"]["prompt_by_source"] = {
            "gpu_cache_hit": local,
            "cpu_or_external_cache_hit": external,
            "computed": by_source.get("local_compute"),
            "raw": by_source,
        }
    elif gpu_rate is not None:
        flat["server_overall_cache_hit_rate"] = gpu_rate
    flat["gpu_kv_cache_usage_pct"] = normalize_fraction(gauge_stat(metrics, _VLLM_USAGE))
    flat["cpu_kv_cache_usage_pct"] = normalize_fraction(
        gauge_stat(metrics, "vllm:cpu_kv_cache_usage_perc")
    )
    offload = {}
    for what in ("bytes", "time"):
        for way in ("gpu_to_cpu", "cpu_to_gpu"):
            offload[f"{what}_{way}"] = sum_stat(metrics, f"vllm:kv_offload_{what}_{way}")
    for way in ("gpu_to_cpu", "cpu_to_gpu"):
        offload[f"bandwidth_{way}_bytes_per_second"] = rate(
            offload[f"bytes_{way}"], offload[f"time_{way}"]
        )
    flat |= {f"kv_offload_{key}": value for key, value in offload.items()}
    nested["cache"] |= {
        "gpu_cache_hit_rate": flat["server_gpu_cache_hit_rate"],
        "cpu_cache_hit_rate": flat["server_cpu_cache_hit_rate"],
        "external_cache_hit_rate": flat["server_external_cache_hit_rate"],
        "overall_cache_hit_rate": flat["server_overall_cache_hit_rate"],
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "external_prefix_cache_hits": ext_hits,
        "external_prefix_cache_queries": ext_queries,
    }
    nested["kv_cache"] |= {
        "gpu_usage_pct": flat["gpu_kv_cache_usage_pct"],
        "cpu_usage_pct": flat["cpu_kv_cache_usage_pct"],
    }
    nested["kv_offload"] |= offload
    nested["tokens"] |= {
        "prompt_total": flat["total_prompt_tokens"],
        "generation_total": flat["total_generation_tokens"],
    }
    nested["sources"] = _vllm_sources(metrics)
    if not dynamo:
        return
    # Dynamo's frontend and router gauges, on top of its vLLM workers' metrics
    usage = normalize_fraction(gauge_stat(metrics, "dynamo_component_gpu_cache_usage_percent"))
    if flat["gpu_kv_cache_usage_pct"] is None:
        flat["gpu_kv_cache_usage_pct"] = usage
        nested["kv_cache"]["gpu_usage_pct"] = usage
    cached = sum_stat(metrics, "dynamo_frontend_cached_tokens")
    inputs = sum_stat(metrics, "dynamo_frontend_input_sequence_tokens")
    frontend_rate = rate(cached, inputs)
    avg_keys = ("avg", "max", "total")
    router_rate = normalize_fraction(
        gauge_stat(metrics, "dynamo_component_router_kv_hit_rate", avg_keys, "avg")
    )
    shared_rate = normalize_fraction(
        gauge_stat(metrics, "dynamo_component_router_shared_cache_hit_rate", avg_keys, "avg")
    )
    if flat["server_overall_cache_hit_rate"] is None:
        flat["server_overall_cache_hit_rate"] = frontend_rate or shared_rate
    nested["cache"] |= {
        "frontend_cache_hit_rate": frontend_rate,
        "router_kv_hit_rate": router_rate,
        "router_shared_cache_hit_rate": shared_rate,
        "frontend_cached_tokens": cached,
        "frontend_input_tokens": inputs,
    }


def _populate_sglang(metrics: Metrics, flat: dict[str, Any], nested: dict[str, Any]) -> None:
    prompt = sum_stat(metrics, "sglang:prompt_tokens")
    generation = sum_stat(metrics, "sglang:generation_tokens")
    flat["total_prompt_tokens"] = counter_int(prompt)
    flat["total_generation_tokens"] = counter_int(generation)
    cached = sum_by_label(metrics, "sglang:cached_tokens", "cache_source")
    device, host = cached.get("device"), cached.get("host")
    flat["server_gpu_cache_hit_rate"] = rate(device, prompt)
    flat["server_cpu_cache_hit_rate"] = rate(host, prompt)
    # HiCache host hits are external to the GPU cache
    flat["server_external_cache_hit_rate"] = flat["server_cpu_cache_hit_rate"]
    flat["server_overall_cache_hit_rate"] = rate(sum(cached.values()) if cached else None, prompt)
    if flat["server_overall_cache_hit_rate"] is None:
        flat["server_overall_cache_hit_rate"] = normalize_fraction(
            gauge_stat(metrics, "sglang:cache_hit_rate", ("avg", "max", "total"), "avg")
        )
    flat["gpu_kv_cache_usage_pct"] = normalize_fraction(gauge_stat(metrics, "sglang:token_usage"))
    pool = sum_stat(metrics, "sglang:max_total_num_tokens", ("max", "avg", "total", "sum"))
    host_used = gauge_stat(metrics, "sglang:hicache_host_used_tokens")
    host_total = gauge_stat(metrics, "sglang:hicache_host_total_tokens")
    flat["cpu_kv_cache_usage_pct"] = rate(host_used, host_total)
    computed = sum_stat(
        metrics,
        "sglang:realtime_tokens",
        keep=lambda s: label(s, "mode") == "prefill_compute",
    )
    nested["cache"] |= {
        "gpu_cache_hit_rate": flat["server_gpu_cache_hit_rate"],
        "cpu_cache_hit_rate": flat["server_cpu_cache_hit_rate"],
        "external_cache_hit_rate": flat["server_external_cache_hit_rate"],
        "overall_cache_hit_rate": flat["server_overall_cache_hit_rate"],
        "cached_tokens_by_source": cached,
    }
    nested["kv_cache"] |= {
        "gpu_usage_pct": flat["gpu_kv_cache_usage_pct"],
        "gpu_total_tokens": counter_int(pool),
        "cpu_usage_pct": flat["cpu_kv_cache_usage_pct"],
        "cpu_used_tokens": host_used,
        "cpu_total_tokens": host_total,
    }
    nested["tokens"] |= {
        "prompt_total": flat["total_prompt_tokens"],
        "generation_total": flat["total_generation_tokens"],
        "prompt_by_source": {
            "gpu_cache_hit": device,
            "cpu_or_external_cache_hit": host,
            "computed": computed,
            "raw": cached,
        },
    }


def _atom(stem: str, counter: bool = True) -> list[str]:
    """ATOM's direct and colon-normalized names, and AIPerf's _total counter names."""
    names = [f"atom:{stem}", f"atom_{stem}"]
    return [*names, f"atom:{stem}_total", f"atom_{stem}_total"] if counter else names


def _populate_atom(metrics: Metrics, flat: dict[str, Any], nested: dict[str, Any]) -> None:
    flat["total_prompt_tokens"] = counter_int(sum_stat(metrics, _atom("prompt_tokens")))
    flat["total_generation_tokens"] = counter_int(sum_stat(metrics, _atom("generation_tokens")))
    cached = sum_stat(metrics, _atom("prefix_cache_cached_tokens"))
    full = sum_stat(metrics, _atom("prefix_cache_full_tokens"))
    hit_rate = rate(cached, full)
    external = sum_stat(metrics, _atom("lmcache_loaded_tokens"))
    external_rate = rate(external, full)
    # ATOM's admitted-cache counter may already hold a completed LMCache load: not added twice
    flat |= {
        "server_gpu_cache_hit_rate": hit_rate,
        "server_cpu_cache_hit_rate": external_rate,
        "server_external_cache_hit_rate": external_rate,
        "server_overall_cache_hit_rate": hit_rate,
        "gpu_kv_cache_usage_pct": normalize_fraction(
            gauge_stat(metrics, _atom("kv_cache_usage_ratio", counter=False))
        ),
    }
    nested["cache"] |= {
        "gpu_cache_hit_rate": hit_rate,
        "cpu_cache_hit_rate": external_rate,
        "external_cache_hit_rate": external_rate,
        "overall_cache_hit_rate": hit_rate,
        "prefix_cache_hits": cached,
        "prefix_cache_queries": full,
        "external_prefix_cache_hits": external,
        "external_prefix_cache_queries": full,
    }
    nested["kv_cache"]["gpu_usage_pct"] = flat["gpu_kv_cache_usage_pct"]
    nested["tokens"] |= {
        "prompt_total": flat["total_prompt_tokens"],
        "generation_total": flat["total_generation_tokens"],
    }


def backend(metrics: Metrics, framework: str) -> str | None:
    """The adapter InferenceX picks, in its order: dynamo-vllm, atom, sglang, vllm."""
    framework = framework.lower()
    if framework.startswith("dynamo") or any(n.startswith("dynamo_") for n in metrics):
        return "dynamo-vllm"
    for name, prefixes in (
        ("atom", ("atom:", "atom_")),
        ("sglang", ("sglang:",)),
        ("vllm", ("vllm:",)),
    ):
        if any(n.startswith(prefixes) for n in metrics) or (not metrics and framework == name):
            return name
    return None


def _record_token_sum(records: Sequence[AiperfRecord], tag: str) -> int | None:
    total, found = 0, False
    for record in records:
        value = record.value(tag)
        if value is None or isinstance(value, list):
            continue
        try:
            total += int(value)
        except (TypeError, ValueError):
            continue
        found = True
    return total if found else None


def server_metrics(
    export: ServerMetricsExport | None, framework: str, records: Sequence[AiperfRecord]
) -> tuple[dict[str, Any], list[str]]:
    """The aggregate's server_metrics block and its warnings. Token totals the engine does not
    export come from the measured requests; an export of no known engine is refused."""
    metrics: Metrics = {
        name: family.series for name, family in (export.metrics if export else {}).items()
    }
    nested = empty_server_metrics(bool(metrics), len(metrics))
    flat: dict[str, Any] = dict.fromkeys(FLAT_FIELDS)
    warnings: list[str] = []
    name = backend(metrics, framework)
    if not metrics:
        warnings.append("server_metrics_export.json missing or empty")
    elif name is None:
        preview = ", ".join(sorted(metrics)[:10])
        raise UnknownBackend(
            f"aiperf server-metrics export: no vllm:, sglang:, atom: or dynamo_ metric "
            f"(framework={framework.lower()!r}, metric_names=[{preview}]); give aiperf the "
            "engines' /metrics with AIPERF_SERVER_METRICS_URLS"
        )
    else:
        nested["adapter"] = name
        if name == "sglang":
            _populate_sglang(metrics, flat, nested)
        elif name == "atom":
            _populate_atom(metrics, flat, nested)
        else:
            _populate_vllm(metrics, flat, nested, dynamo=name == "dynamo-vllm")
    prompt = _record_token_sum(records, "input_sequence_length")
    generation = _record_token_sum(records, "output_sequence_length")
    tokens = nested["tokens"]
    if flat["total_prompt_tokens"] is None:
        flat["total_prompt_tokens"] = prompt
    if flat["total_generation_tokens"] is None:
        flat["total_generation_tokens"] = generation
    if tokens["prompt_total"] is None or not metrics:
        tokens["prompt_total"] = flat["total_prompt_tokens"]
    if tokens["generation_total"] is None or not metrics:
        tokens["generation_total"] = flat["total_generation_tokens"]
    tokens["requests_completed"] = len(records)
    return nested, warnings
