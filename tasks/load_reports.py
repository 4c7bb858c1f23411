"""The client's load reports as Prefect artifacts: tables, latency histograms, benchmark results."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence
from pathlib import Path

from prefect.artifacts import create_image_artifact, create_table_artifact

from slurmgate.runtime.loadgen.report import ChatReport, read_reports
from slurmgate.runtime.results.judge import judge
from slurmgate.runtime.results.records import ConcurrencyResult, read_records
from slurmgate.tasks.allocation import log, warn

P50_COLOR = "#28a03c"
P99_COLOR = "#d23232"
# A histogram image is a few kilobytes; this size reads well in the UI's artifact page.
FIGURE_INCHES, FIGURE_DPI = (6.0, 2.4), 80


def artifact_key(label: str) -> str:
    """``load-<label>``: Prefect keys hold only lowercase letters, digits and dashes."""
    return "load-" + (re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:40] or "endpoint")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def publish_report(report: ChatReport, run_id: str) -> None:
    """One report: its table (``load-<label>``) and, when it has latencies, the end-to-end
    latency histogram as an image artifact (``load-<label>-e2e``)."""
    key = artifact_key(report.label)
    how = (
        f"{report.offered_rate:g} req/s {report.arrivals} arrivals"
        if report.mode == "open"
        else f"concurrency {report.concurrency}"
    )
    create_table_artifact(
        table=report.table(),
        key=key,
        description=(
            f"Streaming chat load on {report.label} in run {run_id}: {how}, prompt "
            f"{report.prompt_tokens_dist} and output {report.output_tokens_dist} tokens, "
            f"{report.elapsed:.1f} s"
        ),
    )
    buckets = report.e2e_histogram
    edges, counts = buckets.get("edges", []), buckets.get("counts", [])
    if not counts or len(edges) != len(counts) + 1:
        return
    png = histogram_png(counts, edges, p50=report.e2e["p50"], p99=report.e2e["p99"])
    if png is None:
        log(f"run {run_id}: no latency histogram image: install slurmgate[plots] (matplotlib)")
        return
    create_image_artifact(
        image_url="data:image/png;base64," + base64.b64encode(png).decode("ascii"),
        key=f"{key}-e2e",
        description=(
            f"End-to-end latency of {report.ok} requests on {report.label} (run {run_id}): "
            f"{len(counts)} bars from {_ms(edges[0])} to {_ms(edges[-1])}; "
            f"green line p50 {_ms(report.e2e['p50'])}, red line p99 {_ms(report.e2e['p99'])}"
        ),
    )


def histogram_png(
    counts: Sequence[float], edges: Sequence[float], *, p50: float | None, p99: float | None
) -> bytes | None:
    """The end-to-end latency histogram as a PNG (matplotlib, the `plots` extra), with its p50
    and p99 as vertical lines; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=FIGURE_INCHES, dpi=FIGURE_DPI)
    try:
        millis = [e * 1e3 for e in edges]
        ax.stairs(counts, millis, fill=True, color="#426ec8")
        for value, color, name in ((p50, P50_COLOR, "p50"), (p99, P99_COLOR, "p99")):
            if value is not None:
                ax.axvline(value * 1e3, color=color, label=f"{name} {value * 1e3:.1f} ms")
        ax.set_xlabel("end-to-end latency (ms)")
        ax.set_ylabel("requests")
        ax.legend(loc="upper right", fontsize="small")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(fig)


def result_key(result: ConcurrencyResult) -> str:
    """``result-<tool>-c<N>-<via>``: one table per benchmark tool, concurrency and place."""
    return artifact_key(f"{result.tool}-c{result.concurrency}-{result.measured_via}").replace(
        "load-", "result-", 1
    )


def publish_result(result: ConcurrencyResult, run_id: str) -> None:
    """One concurrency's benchmark result as a table: TTFT, ITL and E2E percentiles, then
    throughput; the description says where it was measured and InferenceX's verdict."""
    verdict = judge(result)
    where = "the frontend directly" if result.measured_via == "frontend" else "slurmgate's endpoint"
    create_table_artifact(
        table=result.table(),
        key=result_key(result),
        description=(
            f"{result.tool} at concurrency {result.concurrency} in run {run_id}, measured at "
            f"{result.measured_url} ({where}): "
            f"{'publishable' if verdict.ok else 'refused'}: {verdict.reason}"
        ),
    )


def publish_results(directory: Path, run_id: str) -> int:
    """Publish every benchmark result record the client wrote to ``directory`` (`slurmgate
    results judge|write`); never raises. Returns how many were published."""
    try:
        results, skipped = read_records(directory)
    except Exception as exc:  # an unreadable directory: say so and go on
        warn(f"run {run_id}: benchmark results not read: {type(exc).__name__}: {exc}")
        return 0
    for line in skipped:
        warn(f"run {run_id}: benchmark result skipped: {line}")
    published = 0
    for result in results:
        try:
            publish_result(result, run_id)
            published += 1
        except Exception as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            warn(
                f"run {run_id}: result at concurrency {result.concurrency} not published: {reason}"
            )
    if published:
        log(f"run {run_id}: published {published} benchmark result table(s) as artifacts")
    return published


def publish_load_reports(directory: Path, run_id: str) -> int:
    """Publish every report the client wrote to ``directory`` (the run's reports directory),
    and its benchmark result records; never raises: the client's numbers are worth a warning,
    not a failed run. Returns how many load reports were published."""
    publish_results(directory, run_id)
    try:
        reports = read_reports(directory, warn)
    except Exception as exc:  # an unreadable directory: say so and go on
        warn(f"run {run_id}: client load reports not read: {type(exc).__name__}: {exc}")
        return 0
    published = 0
    for report in reports:
        try:
            publish_report(report, run_id)
            published += 1
        except Exception as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            warn(f"run {run_id}: load report of {report.label} not published: {reason}")
    if published:
        log(f"run {run_id}: published {published} client load report(s) as artifacts")
    return published
