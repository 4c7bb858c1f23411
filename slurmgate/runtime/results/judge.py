"""Whether one concurrency's result is publishable: tokens served, errors in InferenceX's bound."""

from __future__ import annotations

from dataclasses import dataclass

from slurmgate.runtime.results.records import ConcurrencyResult

# InferenceX's bound on failed requests, inclusive: AIPERF_FAILED_REQUEST_THRESHOLD, 0.10, at
# SemiAnalysisAI/InferenceX 843c6254 .github/workflows/benchmark-tmpl.yml line 197 and
# benchmarks/benchmark_lib.sh line 1795, applied by
# utils/agentic/validation/validate_agentic_result.py as errors / completed > threshold. The
# fixed-sequence-length path has no bound of its own there (benchmark_serving.py only warns
# when nothing completed), so slurmgate holds sa-bench results to the same one.
FAILED_REQUEST_THRESHOLD = 0.10


@dataclass(frozen=True)
class Verdict:
    """A judged result: publishable, or the one-line reason it is not."""

    ok: bool
    reason: str


def judge(result: ConcurrencyResult, threshold: float = FAILED_REQUEST_THRESHOLD) -> Verdict:
    """Refuse a benchmark that completed no request, served no output token, or failed more
    than ``threshold`` of its finished requests."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be between 0 and 1, not {threshold}")
    where = f"{result.tool} at concurrency {result.concurrency} on {result.measured_url}"
    finished = result.requests_completed + result.requests_failed
    if result.requests_completed == 0:
        return Verdict(False, f"{where}: no request completed ({finished} finished, all failed)")
    if result.total_output_tokens == 0 or result.output_throughput == 0:
        return Verdict(
            False,
            f"{where}: served 0 output tokens in {result.requests_completed} completed "
            "requests; the engine answered without generating",
        )
    rate = result.error_rate
    if rate > threshold:
        return Verdict(
            False,
            f"{where}: request error rate {result.requests_failed}/{finished} = {rate:.3%} is "
            f"above InferenceX's bound of {threshold:.3%}",
        )
    return Verdict(
        True,
        f"{where}: {result.requests_failed}/{finished} = {rate:.3%} failed, within "
        f"{threshold:.3%}; {result.total_output_tokens} output tokens",
    )
