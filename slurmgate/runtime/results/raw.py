"""The benchmark tools' raw output, read under bounds and typed: sa-bench's JSON, aiperf's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from slurmgate.errors import InputError
from slurmgate.runtime.results.records import ConcurrencyResult, Latency, MeasuredVia

# srt-slurm's sa-bench saves every request's generated text, TTFT and ITLs beside the summary
# (its benchmark_serving.py keeps them in --save-result), so a real file at high concurrency
# and long outputs reaches tens of megabytes; past this it is not one benchmark's output.
MAX_RAW_BYTES = 256 * 1024 * 1024
# aiperf's aggregate export is a summary of a few kilobytes, whatever the run's size.
MAX_AIPERF_BYTES = 16 * 1024 * 1024
MAX_TOP_LEVEL_KEYS = 4096
MAX_REQUESTS = 10_000_000

Finite = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_REQUESTS * 1_000_000)]


class RawInputError(InputError):
    """A benchmark tool's output file that is missing, too big, not JSON or of the wrong shape."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_object(path: Path, max_bytes: int, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, refused before reading when larger than ``max_bytes``, and
    refused when it holds NaN or Infinity (Python's json would take them)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise RawInputError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    if size > max_bytes:
        raise RawInputError(
            f"{what} {path}: {size} bytes is more than the {max_bytes} a benchmark writes; "
            "point at the tool's result file"
        )
    try:
        data = json.loads(path.read_bytes(), parse_constant=_refuse_constant)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise RawInputError(f"{what} {path}: not JSON: {reason}") from None
    if not isinstance(data, dict):
        raise RawInputError(f"{what} {path}: holds a {type(data).__name__}, not a JSON object")
    if len(data) > MAX_TOP_LEVEL_KEYS:
        raise RawInputError(f"{what} {path}: {len(data)} top-level fields; it is not a result")
    return data


def _field_error(path: Path, what: str, exc: ValidationError) -> RawInputError:
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(the object)"
    return RawInputError(
        f"{what} {path}: field {field}: {first['msg']}; "
        f"fix the file or point at {what}'s own output"
    )


class SaBenchOutput(BaseModel):
    """The JSON srt-slurm's sa-bench writes per concurrency, with --save-result: vLLM's
    benchmark_serving format. Fields from NVIDIA/srt-slurm c88ef731
    src/srtctl/benchmarks/scripts/sa-bench/benchmark_serving.py (blob 1b783b65): ``main()``'s
    result_json (model_id, num_prompts, max_concurrency) merged with ``benchmark()``'s result
    (duration .. total_token_throughput, errors) and its process_one_metric keys
    (mean_/median_/std_/p<N>_ of ttft, tpot, itl, e2el, in ms). InferenceX's
    utils/process_result.py reads max_concurrency, model_id, total_token_throughput,
    output_throughput and every key ending in ``ms``."""

    model_config = ConfigDict(extra="allow")

    model_id: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    num_prompts: Annotated[Count, Field(ge=1)]
    max_concurrency: Annotated[StrictInt, Field(ge=1, le=1_000_000)]
    duration: Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)]
    completed: Count
    total_input_tokens: Count
    total_output_tokens: Count
    request_throughput: Finite
    output_throughput: Finite
    total_token_throughput: Finite
    # One entry per request, "" when it succeeded; only with the detailed save.
    errors: Annotated[list[StrictStr], Field(max_length=MAX_REQUESTS)] | None = None

    def latency_ms(self) -> dict[str, float]:
        """Every summary key ending in ``ms`` (what process_result.py converts), checked to be a
        finite non-negative number; a bad one is refused by its name."""
        found: dict[str, float] = {}
        for key, value in (self.model_extra or {}).items():
            if not key.endswith("ms"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"field {key}: must be a number, not {type(value).__name__}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"field {key}: must be a finite number >= 0, not {value}")
            found[key] = float(value)
        return found


def _latency(values: dict[str, float], metric: str) -> Latency | None:
    mean, median = values.get(f"mean_{metric}_ms"), values.get(f"median_{metric}_ms")
    if mean is None or median is None:
        return None

    def seconds(key: str) -> float | None:
        value = values.get(f"{key}_{metric}_ms")
        return None if value is None else value / 1000.0

    return Latency(
        mean=mean / 1000.0,
        median=median / 1000.0,
        p90=seconds("p90"),
        p95=seconds("p95"),
        p99=seconds("p99"),
        std=seconds("std"),
    )


def read_sa_bench(
    path: Path, max_bytes: int = MAX_RAW_BYTES
) -> tuple[SaBenchOutput, dict[str, float]]:
    """sa-bench's result file, typed, with its ``*ms`` latency keys; InputError naming the field
    when it is not one."""
    data = read_json_object(path, max_bytes, "sa-bench result")
    try:
        raw = SaBenchOutput.model_validate(data)
    except ValidationError as exc:
        raise _field_error(path, "sa-bench result", exc) from None
    try:
        latencies = raw.latency_ms()
    except ValueError as exc:
        raise RawInputError(f"sa-bench result {path}: {exc}; fix the file") from None
    if raw.completed > raw.num_prompts:
        raise RawInputError(
            f"sa-bench result {path}: field completed: {raw.completed} is more than "
            f"num_prompts {raw.num_prompts}; the file is not one benchmark's output"
        )
    return raw, latencies


def sa_bench_result(
    raw: SaBenchOutput, latencies: dict[str, float], *, url: str, via: MeasuredVia
) -> ConcurrencyResult:
    """The typed record of one sa-bench run. Failed requests are those sent and not completed
    (benchmark_serving counts a request completed only when it succeeded)."""
    return ConcurrencyResult(
        tool="sa-bench",
        concurrency=raw.max_concurrency,
        measured_url=url,
        measured_via=via,
        requests_sent=raw.num_prompts,
        requests_completed=raw.completed,
        requests_failed=raw.num_prompts - raw.completed,
        duration_s=raw.duration,
        total_input_tokens=raw.total_input_tokens,
        total_output_tokens=raw.total_output_tokens,
        request_throughput=raw.request_throughput,
        output_throughput=raw.output_throughput,
        total_token_throughput=raw.total_token_throughput,
        ttft=_latency(latencies, "ttft"),
        itl=_latency(latencies, "itl"),
        e2el=_latency(latencies, "e2el"),
        tpot=_latency(latencies, "tpot"),
    )


class AiperfMetric(BaseModel):
    """One metric of aiperf's aggregate export: ai-dynamo/aiperf
    aiperf/common/models/export_models.py ``JsonMetricResult`` (unit, avg, p1..p99, min, max,
    std; aiperf 0.13 adds count and sum), values in the unit's display form (ms for latencies,
    per second for rates). A statistic aiperf adds later is ignored."""

    model_config = ConfigDict(extra="ignore")

    unit: Annotated[StrictStr, Field(max_length=64)]
    avg: Finite | None = None
    p1: Finite | None = None
    p5: Finite | None = None
    p10: Finite | None = None
    p25: Finite | None = None
    p50: Finite | None = None
    p75: Finite | None = None
    p90: Finite | None = None
    p95: Finite | None = None
    p99: Finite | None = None
    min: Finite | None = None
    max: Finite | None = None
    std: Finite | None = None
    count: Count | None = None
    sum: Annotated[float, Field(allow_inf_nan=False, strict=True)] | None = None


class AiperfExport(BaseModel):
    """aiperf's ``profile_export_aiperf.json``: ``JsonExportData`` (same file of aiperf), one
    AiperfMetric per metric tag; the rest (input_config, error_summary, times) is not read.
    InferenceX's utils/agentic/validation/validate_agentic_result.py reads request_count,
    error_request_count and completed_request_count (``avg`` each)."""

    model_config = ConfigDict(extra="allow")

    request_count: AiperfMetric
    error_request_count: AiperfMetric | None = None
    completed_request_count: AiperfMetric | None = None
    request_throughput: AiperfMetric | None = None
    output_token_throughput: AiperfMetric | None = None
    # aiperf 0.13 exports it; older exports leave it to total_isl over benchmark_duration
    total_token_throughput: AiperfMetric | None = None
    time_to_first_token: AiperfMetric | None = None
    inter_token_latency: AiperfMetric | None = None
    request_latency: AiperfMetric | None = None
    benchmark_duration: AiperfMetric | None = None
    total_isl: AiperfMetric | None = None
    total_osl: AiperfMetric | None = None
    total_output_tokens: AiperfMetric | None = None

    def profiled_concurrency(self) -> int | None:
        """The profiling phase's concurrency, from aiperf 0.13's ``input_config.phases``
        (``{"kind": "profiling", "concurrency": N}``); None when the export does not say."""
        config = (self.model_extra or {}).get("input_config")
        phases = config.get("phases") if isinstance(config, dict) else None
        if not isinstance(phases, list):
            return None
        for phase in phases[:64]:
            if isinstance(phase, dict) and phase.get("kind") == "profiling":
                value = phase.get("concurrency")
                if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                    return value
        return None


_TO_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def _aiperf_latency(metric: AiperfMetric | None, tag: str) -> Latency | None:
    if metric is None or metric.avg is None or metric.p50 is None:
        return None
    scale = _TO_SECONDS.get(metric.unit)
    if scale is None:
        raise InputError(f"aiperf export: field {tag}.unit: {metric.unit!r} is not a time unit")

    def seconds(value: float | None) -> float | None:
        return None if value is None else value * scale

    return Latency(
        mean=metric.avg * scale,
        median=metric.p50 * scale,
        p90=seconds(metric.p90),
        p95=seconds(metric.p95),
        p99=seconds(metric.p99),
        std=seconds(metric.std),
    )


def _avg(metric: AiperfMetric | None) -> float | None:
    return None if metric is None else metric.avg


def read_aiperf(path: Path, max_bytes: int = MAX_AIPERF_BYTES) -> AiperfExport:
    """aiperf's aggregate export, typed; InputError naming the field when it is not one."""
    data = read_json_object(path, max_bytes, "aiperf export")
    try:
        return AiperfExport.model_validate(data)
    except ValidationError as exc:
        raise _field_error(path, "aiperf export", exc) from None


def aiperf_result(
    export: AiperfExport, *, concurrency: int | None, url: str, via: MeasuredVia
) -> ConcurrencyResult:
    """The typed record of one aiperf run. aiperf's request_count counts the successful
    requests; completed_request_count, when the export has it, counts every finished one, as
    InferenceX's validator reads them. The concurrency is the caller's, else the export's."""
    concurrency = concurrency or export.profiled_concurrency()
    if concurrency is None:
        raise InputError("aiperf export names no profiling concurrency; give the run's")
    successes = _avg(export.request_count) or 0.0
    errors = _avg(export.error_request_count) or 0.0
    finished = _avg(export.completed_request_count)
    if finished is None:
        finished = successes + errors
    duration = _avg(export.benchmark_duration) or 0.0
    output_tokens = _avg(export.total_output_tokens) or _avg(export.total_osl) or 0.0
    input_tokens = _avg(export.total_isl)
    output_rate = _avg(export.output_token_throughput) or 0.0
    total_rate = _avg(export.total_token_throughput)
    if total_rate is None and input_tokens is not None and duration > 0:
        total_rate = (input_tokens + output_tokens) / duration
    return ConcurrencyResult(
        tool="aiperf",
        concurrency=concurrency,
        measured_url=url,
        measured_via=via,
        requests_sent=round(finished),
        requests_completed=round(successes),
        requests_failed=round(errors),
        duration_s=duration,
        total_input_tokens=None if input_tokens is None else round(input_tokens),
        total_output_tokens=round(output_tokens),
        request_throughput=_avg(export.request_throughput) or 0.0,
        output_throughput=output_rate,
        total_token_throughput=total_rate,
        ttft=_aiperf_latency(export.time_to_first_token, "time_to_first_token"),
        itl=_aiperf_latency(export.inter_token_latency, "inter_token_latency"),
        e2el=_aiperf_latency(export.request_latency, "request_latency"),
    )


# aiperf's per-request export holds one line per request, warmup included; a day-long replay at
# a few hundred requests a second stays under this.
MAX_AIPERF_RECORDS_BYTES = 4 * 1024 * 1024 * 1024
MAX_AIPERF_RECORD_LINE = 16 * 1024 * 1024
# The server-metrics export carries a 1 s timeslice per series (--slice-duration 1.0), so a long
# run at many endpoints is large; it is read whole, as InferenceX's script reads it.
MAX_SERVER_METRICS_BYTES = 2 * 1024 * 1024 * 1024

# A metric value as aiperf writes it: a number, or a list (inter_chunk_latency) or text that
# InferenceX's float()/int() reads as nothing.
MetricValue = float | list[float | None] | str | None


class AiperfRecordMetric(BaseModel):
    """One metric of one request: ``{"value": ..., "unit": ...}``."""

    model_config = ConfigDict(extra="ignore")

    value: MetricValue = None
    unit: Annotated[StrictStr, Field(max_length=64)] | None = None


class AiperfRecordMetadata(BaseModel):
    """The fields of a record's metadata InferenceX's aggregation reads; the rest is ignored."""

    model_config = ConfigDict(extra="ignore")

    benchmark_phase: Annotated[StrictStr, Field(max_length=64)] | None = None
    request_start_ns: Annotated[int, Field(ge=0)] | None = None
    request_end_ns: Annotated[int, Field(ge=0)] | None = None
    conversation_id: Annotated[StrictStr, Field(max_length=4096)] | None = None
    turn_index: Annotated[int, Field(ge=0)] | None = None


class AiperfRecordError(BaseModel):
    """A failed request's error (aiperf's ErrorDetails: code, type, message)."""

    model_config = ConfigDict(extra="allow")

    code: int | str | None = None
    type: Annotated[StrictStr, Field(max_length=4096)] | None = None
    message: Annotated[StrictStr, Field(max_length=1_000_000)] | None = None


class AiperfRecord(BaseModel):
    """One line of aiperf's ``profile_export.jsonl`` (``--export-level records``, its
    default): the request's metadata, its metrics and its error when it failed."""

    model_config = ConfigDict(extra="ignore")

    metadata: AiperfRecordMetadata = Field(default_factory=AiperfRecordMetadata)
    metrics: dict[str, AiperfRecordMetric] = Field(default_factory=dict)
    error: AiperfRecordError | StrictStr | None = None

    def value(self, tag: str) -> MetricValue:
        metric = self.metrics.get(tag)
        return None if metric is None else metric.value

    @property
    def failed(self) -> bool:
        """The request failed: an error that says anything (an empty one is none)."""
        if isinstance(self.error, AiperfRecordError):
            return bool(self.error.model_fields_set or self.error.model_extra)
        return bool(self.error)

    @property
    def profiled(self) -> bool:
        """A measured request: no phase (older exports) or the profiling phase."""
        phase = self.metadata.benchmark_phase
        return phase is None or phase == "profiling"


def read_aiperf_records(
    path: Path, max_bytes: int = MAX_AIPERF_RECORDS_BYTES
) -> list[AiperfRecord]:
    """Every request of aiperf's per-request export, typed; a bad line is refused by its number
    and field (a partial export is not a run's result)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise RawInputError(
            f"aiperf per-request export {path}: cannot read it: {exc.strerror or exc}; "
            "run aiperf with --export-level records (its default)"
        ) from None
    if size > max_bytes:
        raise RawInputError(
            f"aiperf per-request export {path}: {size} bytes is more than {max_bytes}"
        )
    found: list[AiperfRecord] = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if len(line) > MAX_AIPERF_RECORD_LINE:
                raise RawInputError(f"aiperf per-request export {path}: line {number} is too long")
            if not line.strip():
                continue
            try:
                data = json.loads(line, parse_constant=_refuse_constant)
            except ValueError as exc:
                reason = " ".join(str(exc).split())[:200]
                raise RawInputError(
                    f"aiperf per-request export {path}: line {number}: not JSON: {reason}"
                ) from None
            try:
                found.append(AiperfRecord.model_validate(data))
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(part) for part in first["loc"]) or "(the object)"
                raise RawInputError(
                    f"aiperf per-request export {path}: line {number}: field {field}: "
                    f"{first['msg']}"
                ) from None
    return found


class ServerMetricSeries(BaseModel):
    """One labelled series of one metric, its statistics over the profiling window (counters:
    total, rate; gauges: avg, min, max, p..); its timeslices are not read."""

    model_config = ConfigDict(extra="ignore")

    endpoint_url: Annotated[StrictStr, Field(max_length=2048)] | None = None
    labels: dict[str, str | int | float | bool | None] | None = None
    stats: dict[str, float | None] | None = None


class ServerMetricFamily(BaseModel):
    """One metric of the server-metrics export: its type and its series."""

    model_config = ConfigDict(extra="ignore")

    type: Annotated[StrictStr, Field(max_length=64)] | None = None
    series: list[ServerMetricSeries] = Field(default_factory=list)


class ServerMetricsExport(BaseModel):
    """aiperf's ``server_metrics_export.json``: every Prometheus metric it scraped from the
    endpoint's ``/metrics`` (and each ``--server-metrics`` URL), by name."""

    model_config = ConfigDict(extra="ignore")

    metrics: dict[str, ServerMetricFamily] = Field(default_factory=dict)


def read_server_metrics(
    path: Path, max_bytes: int = MAX_SERVER_METRICS_BYTES
) -> ServerMetricsExport | None:
    """aiperf's server-metrics export, typed; None when aiperf wrote none (no /metrics)."""
    if not path.exists():
        return None
    data = read_json_object(path, max_bytes, "aiperf server-metrics export")
    try:
        return ServerMetricsExport.model_validate(data)
    except ValidationError as exc:
        raise _field_error(path, "aiperf server-metrics export", exc) from None
