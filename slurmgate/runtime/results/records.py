"""One concurrency's benchmark result, typed: throughput, latencies, errors, where measured."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]

# Where the client pointed the benchmark: the serving frontend itself (the engines' router), or
# slurmgate's endpoint in front of it; the two numbers differ by the endpoint's own cost.
MeasuredVia = Literal["frontend", "slurmgate"]
Tool = Literal["sa-bench", "aiperf"]

RECORD_PREFIX = "result-"
# A run writes one record per concurrency it measured; more than this is not a benchmark sweep.
MAX_RECORD_FILES = 256
MAX_RECORD_BYTES = 64 * 1024


class Latency(BaseModel):
    """One latency's distribution over a benchmark's requests, in seconds. The tools report
    different percentiles (sa-bench those of --metric-percentiles, srt-slurm's default is 99
    only; aiperf p1..p99), so all but mean and median may be missing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mean: Seconds
    median: Seconds
    p90: Seconds | None = None
    p95: Seconds | None = None
    p99: Seconds | None = None
    std: Seconds | None = None


class ConcurrencyResult(BaseModel):
    """What one benchmark at one concurrency measured, whichever tool measured it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool: Tool
    concurrency: Annotated[int, Field(ge=1)]
    measured_url: Annotated[str, Field(min_length=1, max_length=2048)]
    measured_via: MeasuredVia
    requests_sent: Count
    requests_completed: Count
    requests_failed: Count
    duration_s: Seconds
    total_input_tokens: Count | None
    total_output_tokens: Count
    request_throughput: Rate
    output_throughput: Rate
    total_token_throughput: Rate | None
    ttft: Latency | None
    itl: Latency | None
    e2el: Latency | None
    tpot: Latency | None = None

    @property
    def error_rate(self) -> float:
        """Failed over finished requests, the ratio InferenceX's validator bounds; 0 when none
        finished (the judge says that case on its own)."""
        finished = self.requests_completed + self.requests_failed
        return self.requests_failed / finished if finished else 0.0

    def table(self) -> list[dict[str, str]]:
        """Rows for a table: one per latency (mean, median, p90, p99 in ms), then throughput and
        failures in the mean column."""
        rows: list[dict[str, str]] = []
        for name, latency in (("TTFT", self.ttft), ("ITL", self.itl), ("E2E", self.e2el)):
            if latency is None:
                continue
            cells = {"metric": name}
            for stat in ("mean", "median", "p90", "p99"):
                value = getattr(latency, stat)
                cells[stat] = "-" if value is None else f"{value * 1e3:.1f} ms"
            rows.append(cells)
        total = self.total_token_throughput
        for metric, value in (
            ("requests/s", f"{self.request_throughput:.2f}"),
            ("output tok/s", f"{self.output_throughput:.1f}"),
            ("total tok/s", "-" if total is None else f"{total:.1f}"),
            ("failed / sent", f"{self.requests_failed} / {self.requests_sent}"),
        ):
            rows.append({"metric": metric, "mean": value, "median": "-", "p90": "-", "p99": "-"})
        return rows


def record_name(result: ConcurrencyResult) -> str:
    """``result-<tool>-conc<N>-<via>.json``: one file per concurrency and place measured."""
    return f"{RECORD_PREFIX}{result.tool}-conc{result.concurrency}-{result.measured_via}.json"


def save_record(result: ConcurrencyResult, directory: Path) -> Path:
    """Write the record into ``directory`` (the run's reports directory); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / record_name(result)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(result.model_dump_json(indent=2) + "\n")
    partial.replace(target)
    return target


_RECORD_FILE = re.compile(rf"{RECORD_PREFIX}[a-z-]+-conc\d+-[a-z]+\.json")


def read_records(directory: Path) -> tuple[list[ConcurrencyResult], list[str]]:
    """The records a client left in ``directory``, by tool and concurrency, and one line per
    file skipped (too big, unreadable, not a record): the client is outside code."""
    if not directory.is_dir():
        return [], []
    files = sorted(p for p in directory.iterdir() if _RECORD_FILE.fullmatch(p.name))
    skipped: list[str] = []
    if len(files) > MAX_RECORD_FILES:
        skipped.append(f"{len(files)} result records; reading the first {MAX_RECORD_FILES}")
        files = files[:MAX_RECORD_FILES]
    adapter = TypeAdapter(ConcurrencyResult)
    found: list[ConcurrencyResult] = []
    for path in files:
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
            found.append(adapter.validate_json(path.read_bytes()))
        except (OSError, ValueError, ValidationError) as exc:
            skipped.append(f"{path.name}: {' '.join(str(exc).split())[:200]}")
    found.sort(key=lambda r: (r.tool, r.measured_via, r.concurrency))
    return found, skipped
