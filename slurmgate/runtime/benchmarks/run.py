"""Runs a benchmark tool's processes one after another and fails on a tool error or 0 tokens.

Each process writes into the results folder what the tool itself writes (sa-bench's result
JSON, AIPerf's artifact folder) and its output into a log beside it. The endpoint's token goes
to the tool as `OPENAI_API_KEY` in its environment, where both tools read it, never in argv.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurmgate.errors import ExternalError, InputError
from slurmgate.runtime.benchmarks import aiperf, sabench
from slurmgate.runtime.results import judge, raw, records
from slurmgate.settings.handed import (
    CLIENT_REPORTS_DIR,
    ENDPOINT_TOKEN,
    ENDPOINTS,
    handed,
    inherited,
)

API_KEY = "OPENAI_API_KEY"  # what benchmark_serving.py and AIPerf send as the bearer token


class BenchmarkFailed(ExternalError):
    """The benchmark tool exited with an error, or the deployment served it no tokens."""


@dataclass(frozen=True)
class ToolRun:
    """One process of a benchmark: what it is called in messages, its argv and its log."""

    label: str
    argv: tuple[str, ...]
    log: Path


def tool_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for the tool, with the endpoint's token as OPENAI_API_KEY."""
    env = {**inherited(), **(extra or {})}
    token = handed(ENDPOINT_TOKEN)
    if token:
        env[API_KEY] = token
    return env


def reason_in(log: Path) -> str:
    """The tool's own last word on why it stopped: its last error line, else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln.split(":", 1)[0].lower()]
    found = (errors or lines or ["no output"])[-1]
    return found if len(found) <= 400 else found[:400] + "…"


def run_tool(run: ToolRun, env: dict[str, str], cwd: Path | None = None) -> None:
    """Run one process to its end, its output in `run.log`; a failure names the tool's reason."""
    if not Path(run.argv[0]).exists() and "/" in run.argv[0]:
        raise InputError(
            f"{run.label}: {run.argv[0]} does not exist; build the tool's venv with "
            "SLURMGATE_WITH_BENCH_TOOLS=1 scripts/setup.sh, or give its path (--python, --cli)"
        )
    run.log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {run.label}: {shlex.join(run.argv)}", flush=True)
    with run.log.open("ab") as out:
        done = subprocess.run(
            list(run.argv), env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    if done.returncode != 0:
        raise BenchmarkFailed(
            f"{run.label} exited with {done.returncode}: {reason_in(run.log)} (log {run.log})"
        )


def measured_via(url: str) -> records.MeasuredVia:
    """`slurmgate` when the URL is one of the run's logical endpoints, else `frontend`."""
    try:
        endpoints = json.loads(handed(ENDPOINTS) or "{}")
    except ValueError:
        endpoints = {}
    ours = (
        {str(u).rstrip("/") for u in endpoints.values()} if isinstance(endpoints, dict) else set()
    )
    return "slurmgate" if url.rstrip("/").removesuffix("/v1") in ours else "frontend"


def judged(result: records.ConcurrencyResult, threshold: float) -> None:
    """Keep the result's record for the run's artifacts (in the reports directory a run hands
    its client), then judge it: a failed verdict fails the benchmark with its reason."""
    reports = handed(CLIENT_REPORTS_DIR)
    if reports:
        records.save_record(result, Path(reports))
    verdict = judge.judge(result, threshold)
    if not verdict.ok:
        raise BenchmarkFailed(verdict.reason)
    print(
        f"[bench] {result.tool} concurrency {result.concurrency}: "
        f"{result.output_throughput:.1f} output tok/s, measured at {result.measured_url} "
        f"({result.measured_via})",
        flush=True,
    )


def sa_bench_tokens(saved: Path, label: str) -> int:
    """The tokens a saved sa-bench run counted; 0 tokens or 0 completed requests fail."""
    try:
        result = json.loads(saved.read_text())
    except (OSError, ValueError) as exc:
        raise BenchmarkFailed(f"{label} saved no readable result at {saved}: {exc}") from None
    completed = int(result.get("completed") or 0)
    tokens = int(result.get("total_output_tokens") or 0)
    if completed == 0 or tokens == 0:
        errors = [e for e in result.get("errors") or [] if e]
        first = f"; first error: {errors[0].strip().splitlines()[-1]}" if errors else ""
        raise BenchmarkFailed(
            f"{label} was served {tokens} tokens in {completed} completed requests{first}"
        )
    return tokens


def run_sa_bench(b: sabench.SaBench, python: str, results: Path) -> list[Path]:
    """Every warmup and run of the plan, in order; the result files, each with tokens in it."""
    steps = sabench.plan(b, python, results)
    folder = results / sabench.result_folder(b)
    folder.mkdir(parents=True, exist_ok=True)  # bench.sh makes it before the first run
    env = tool_env()
    saved = []
    for step in steps:
        kind = "warmup" if step.warmup else "run"
        label = f"sa-bench concurrency {step.concurrency} {kind}"
        log = folder / f"sa-bench_concurrency_{step.concurrency}_{kind}.log"
        run_tool(ToolRun(label, step.argv, log), env, cwd=sabench.SCRIPT_DIR)
        if step.saved is not None:
            tokens = sa_bench_tokens(step.saved, label)
            print(f"[bench] {label}: {tokens} tokens, {step.saved}", flush=True)
            output, latencies = raw.read_sa_bench(step.saved)
            judged(
                raw.sa_bench_result(output, latencies, url=b.url, via=measured_via(b.url)),
                judge.FAILED_REQUEST_THRESHOLD,
            )
            saved.append(step.saved)
    return saved


def aiperf_tokens(export: Path, label: str) -> int:
    """The output tokens AIPerf's JSON export counted; none, or every request failed, fails."""
    try:
        result = json.loads(export.read_text())
    except (OSError, ValueError) as exc:
        raise BenchmarkFailed(f"{label} wrote no readable export at {export}: {exc}") from None
    tokens = int(float((result.get("total_output_tokens") or {}).get("avg") or 0))
    if tokens == 0:
        errors = result.get("error_summary") or []
        first = f"; first error: {json.dumps(errors[0])[:300]}" if errors else ""
        raise BenchmarkFailed(f"{label} was served 0 tokens{first}")
    return tokens


def fetch_corpus(loader: str, hf: str, env: dict[str, str], log: Path) -> None:
    """InferenceX's pre-download of a public loader's corpus; refused, never hung, when the
    hub is out of reach or HF_HUB_OFFLINE is set without the corpus in the cache."""
    dataset = aiperf.CORPORA[loader]
    why = aiperf.corpus_probe(dataset, env)
    if why is not None:
        raise aiperf.unavailable(loader, why, env)
    try:
        run_tool(ToolRun(f"hf download {dataset}", tuple(aiperf.fetch_argv(hf, loader)), log), env)
    except BenchmarkFailed:
        raise aiperf.unavailable(loader, reason_in(log), env) from None


def run_aiperf(
    r: aiperf.AgenticReplay, cli: str, results: Path, extra_env: Mapping[str, str]
) -> list[Path]:
    """Every concurrency's `aiperf profile`, in order; each one's JSON export, with tokens in it.

    `extra_env` is the recipe's benchmark env (AIPerf reads its AIPERF_* settings there)."""
    env = tool_env({**aiperf.REPLAY_ENV, **extra_env})
    results.mkdir(parents=True, exist_ok=True)
    if r.loader is not None:
        hf = str(Path(cli).with_name("hf"))
        fetch_corpus(r.loader, hf, env, results / "corpus_download.log")
    exports = []
    for step in aiperf.plan(r, cli, results):
        folder = step.artifacts.parent
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "benchmark_command.txt").write_text(shlex.join(step.argv) + "\n")
        label = f"aiperf concurrency {step.concurrency}"
        run_tool(ToolRun(label, step.argv, folder / "benchmark.log"), env)
        export = step.artifacts / "profile_export_aiperf.json"
        tokens = aiperf_tokens(export, label)
        print(f"[bench] {label}: {tokens} tokens, {export}", flush=True)
        result = raw.aiperf_result(
            raw.read_aiperf(export),
            concurrency=step.concurrency,
            url=r.url,
            via=measured_via(r.url),
        )
        judged(result, r.failed_request_threshold)
        exports.append(export)
    return exports
