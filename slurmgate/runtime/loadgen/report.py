"""A chat load's report: percentiles and a histogram, a table for people, JSON files.

The client writes its report as ``loadgen-<label>-<n>.json`` in the run's reports directory;
the allocation flow reads them back as outside input (bounded in count and size, validated).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurmgate.runtime.loadgen.workload import LoadInputError

MAX_REPORT_FILES = 64
MAX_REPORT_BYTES = 4 << 20
HISTOGRAM_BUCKETS = 20


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list; NaN when it is empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def histogram(values: list[float], buckets: int = HISTOGRAM_BUCKETS) -> dict[str, list[float]]:
    """Equal-width buckets from the smallest to the largest value: ``edges`` (buckets + 1) and
    ``counts``; empty lists without values."""
    if not values:
        return {"edges": [], "counts": []}
    low, high = min(values), max(values)
    width = (high - low) / buckets if high > low else 1.0
    counts = [0] * buckets
    for value in values:
        counts[min(buckets - 1, int((value - low) / width))] += 1
    return {
        "edges": [low + i * width for i in range(buckets + 1)],
        "counts": [float(c) for c in counts],
    }


def latency_stats(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and mean of `values`; None where there are none."""
    ordered = sorted(values)

    def clean(value: float) -> float | None:
        return None if math.isnan(value) else value

    return {
        "p50": clean(percentile(ordered, 50)),
        "p90": clean(percentile(ordered, 90)),
        "p99": clean(percentile(ordered, 99)),
        "mean": sum(ordered) / len(ordered) if ordered else None,
    }


@dataclass
class ChatReport:
    """The outcome of a streaming chat load; latencies in seconds, ``null`` when none."""

    label: str
    mode: str
    offered_rate: float | None
    arrivals: str | None
    concurrency: int | None
    prompt_tokens_dist: str
    output_tokens_dist: str
    seed: int
    sent: int
    ok: int
    throttled: int
    errors: dict[str, int]
    malformed_events: int
    elapsed: float
    request_rate: float
    output_tokens: int
    output_token_rate: float
    prompt_tokens: int | None
    tokens_from: str
    ttft: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    e2e_histogram: dict[str, list[float]]
    retry_after_waited: float
    server_timed: list[dict[str, float]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> list[dict[str, str]]:
        """Rows for people: one per latency, then the rates and counts."""

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.1f}"

        rows = [
            {"metric": f"{name} (ms)", **{k: ms(v) for k, v in stats.items()}}
            for name, stats in (("TTFT", self.ttft), ("ITL", self.itl), ("e2e", self.e2e))
        ]
        # What a server measured of the same requests (llama.cpp's `timings`), beside what the
        # client saw: its prompt time is the floor of TTFT, its time per token the ITL's.
        for name, key in (
            ("engine's prompt time", "server_prompt_ms"),
            ("engine's time per token", "server_predicted_per_token_ms"),
        ):
            values = [row[key] / 1e3 for row in self.server_timed if key in row]
            if values:
                rows.append(
                    {
                        "metric": f"{name} (ms)",
                        **{k: ms(v) for k, v in latency_stats(values).items()},
                    }
                )
        blank = {"p50": "", "p90": "", "p99": "", "mean": ""}
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "0"
        for name, value in (
            ("requests/s", f"{self.request_rate:.2f}"),
            (f"output tokens/s ({self.tokens_from})", f"{self.output_token_rate:.1f}"),
            ("ok / sent", f"{self.ok} / {self.sent}"),
            ("429 (throttled)", str(self.throttled)),
            ("errors", errors),
        ):
            rows.append({"metric": name, **blank, "mean": value})
        return rows

    def render(self) -> str:
        """The table as aligned text."""
        rows = self.table()
        columns = ["metric", "p50", "p90", "p99", "mean"]
        widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
        how = (
            f"rate {self.offered_rate:g}/s ({self.arrivals})"
            if self.mode == "open"
            else f"concurrency {self.concurrency}"
        )
        lines = [
            f"{self.label}: {how}, prompt {self.prompt_tokens_dist}, "
            f"output {self.output_tokens_dist} tokens, {self.elapsed:.2f} s",
            "  ".join(c.ljust(widths[c]) if c == "metric" else c.rjust(widths[c]) for c in columns),
        ]
        for row in rows:
            lines.append(
                "  ".join(
                    row[c].ljust(widths[c]) if c == "metric" else row[c].rjust(widths[c])
                    for c in columns
                )
            )
        return "\n".join(lines)


def write_report(report: ChatReport, path: Path) -> Path:
    """Write the report as JSON (atomically: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    tmp.replace(path)
    return path


def report_path_in(directory: Path, label: str) -> Path:
    """A new file for one report in a reports directory: ``loadgen-<label>-<n>.json``."""
    safe = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:40] or "endpoint"
    for n in range(1, 10_000):
        candidate = directory / f"loadgen-{safe}-{n}.json"
        if not candidate.exists():
            return candidate
    raise LoadInputError(f"{directory} already holds 9999 reports for {label!r}; clear it")


def label_for(url: str, endpoints_json: str | None) -> str:
    """The deployment whose endpoint ``url`` is, from the runtime's SLURMGATE_ENDPOINTS
    (a JSON object name → URL); else the URL's host:port."""
    try:
        endpoints = json.loads(endpoints_json) if endpoints_json else {}
    except ValueError:
        endpoints = {}
    if isinstance(endpoints, dict):
        for name, known in endpoints.items():
            if isinstance(known, str) and known.rstrip("/") == url.rstrip("/"):
                return str(name)
    return re.sub(r"^https?://", "", url).rstrip("/") or "endpoint"


def read_reports(directory: Path, warn: Callable[[str], None]) -> list[ChatReport]:
    """The chat reports a client left in ``directory``, oldest first; a file that is too big,
    unreadable or not a report is skipped with one warning (the client is outside code)."""
    from pydantic import TypeAdapter, ValidationError

    if not directory.is_dir():
        return []
    adapter = TypeAdapter(ChatReport)
    files = sorted(directory.glob("loadgen-*.json"), key=lambda f: f.stat().st_mtime)
    if len(files) > MAX_REPORT_FILES:
        warn(f"{len(files)} load reports in {directory}; publishing the last {MAX_REPORT_FILES}")
        files = files[-MAX_REPORT_FILES:]
    reports: list[ChatReport] = []
    for path in files:
        try:
            if path.stat().st_size > MAX_REPORT_BYTES:
                raise ValueError(f"larger than {MAX_REPORT_BYTES} bytes")
            reports.append(adapter.validate_json(path.read_bytes()))
        except (OSError, ValueError, ValidationError) as exc:
            reason = " ".join(str(exc).split())[:200]
            warn(f"load report {path.name} skipped: {reason}")
    return reports
