"""`slurmgate results judge|write`: a benchmark's raw output judged, and written as InferenceX's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from slurmgate.cli.common import fail
from slurmgate.errors import InputError
from slurmgate.runtime.results.agentic import AGGREGATE_FILE, AgenticJob, write_agentic
from slurmgate.runtime.results.inferencex import RunShape, write_concurrency
from slurmgate.runtime.results.judge import FAILED_REQUEST_THRESHOLD, judge
from slurmgate.runtime.results.raw import (
    aiperf_result,
    read_aiperf,
    read_sa_bench,
    sa_bench_result,
)
from slurmgate.runtime.results.records import ConcurrencyResult, save_record
from slurmgate.settings.handed import handed, inherited

app = typer.Typer(help="Judge a benchmark's raw output; write it as InferenceX's result files.")

Tool = Literal["sa-bench", "aiperf"]
Via = Literal["frontend", "slurmgate"]

RawArg = Annotated[
    Path,
    typer.Argument(
        help="The tool's raw output: sa-bench's results_concurrency_*.json or aiperf's "
        "profile_export_aiperf.json.",
        show_default=False,
    ),
]
UrlOpt = Annotated[str, typer.Option(help="The URL the benchmark measured.", show_default=False)]
ViaOpt = Annotated[
    Via,
    typer.Option(help="What that URL is: the serving frontend directly, or slurmgate's endpoint."),
]
ThresholdOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        help="Largest accepted fraction of failed requests (InferenceX's bound).",
    ),
]


def _reports_dir() -> Path | None:
    from slurmgate.runtime.run.client import CLIENT_REPORTS_ENV

    found = handed(CLIENT_REPORTS_ENV)
    return Path(found) if found else None


def _judged(result: ConcurrencyResult, threshold: float) -> None:
    """Keep the record for the run's artifacts, print the verdict; exit 1 when it fails."""
    reports = _reports_dir()
    if reports is not None:
        try:
            save_record(result, reports)
        except OSError as exc:
            raise fail(f"cannot write the result record to {reports}: {exc.strerror}", 1) from None
    verdict = judge(result, threshold)
    if not verdict.ok:
        raise fail(f"result refused: {verdict.reason}", 1)
    typer.echo(f"result accepted: {verdict.reason}")


@app.command(
    "judge",
    epilog=(
        "Example: slurmgate results judge results_concurrency_64_gpus_12_ctx_4_gen_8.json "
        "--url http://10.0.0.5:8000 --via frontend\n\nExample: slurmgate results judge "
        "aiperf_artifacts/profile_export_aiperf.json --tool aiperf --concurrency 32 "
        "--url http://127.0.0.1:17000 --via slurmgate"
    ),
)
def judge_command(
    raw: RawArg,
    url: UrlOpt,
    via: ViaOpt = "frontend",
    tool: Annotated[Tool, typer.Option(help="Which tool wrote the file.")] = "sa-bench",
    concurrency: Annotated[
        int | None,
        typer.Option(min=1, help="With aiperf: the run's concurrency, when its export omits it."),
    ] = None,
    threshold: ThresholdOpt = FAILED_REQUEST_THRESHOLD,
) -> None:
    """Judge one benchmark's raw output against InferenceX's bound.

    Refused (exit 1) when no output token was served or its error rate is above the bound; the
    record goes to the run's reports directory when the run handed one."""
    try:
        if tool == "sa-bench":
            parsed, latencies = read_sa_bench(raw)
            result = sa_bench_result(parsed, latencies, url=url, via=via)
        else:
            result = aiperf_result(read_aiperf(raw), concurrency=concurrency, url=url, via=via)
    except InputError as exc:
        raise fail(str(exc)) from None
    _judged(result, threshold)


@app.command(
    "write",
    epilog=(
        "Example: slurmgate results write results_concurrency_64_gpus_12_ctx_4_gen_8.json "
        "--url http://10.0.0.5:8000 --config-name 1p1d-dep4-dep8 --out results/\n\n"
        "Example: slurmgate results write conc_16/aiperf_artifacts --tool aiperf "
        "--concurrency 16 --url http://10.0.0.5:8000 --out results/"
    ),
)
def write_command(
    raw: Annotated[
        Path,
        typer.Argument(
            help="sa-bench's results_concurrency_*.json, or aiperf's artifact folder (its "
            "--output-artifact-dir: profile_export.jsonl and the exports beside it).",
            show_default=False,
        ),
    ],
    url: UrlOpt,
    config_name: Annotated[
        str | None,
        typer.Option(
            help="With sa-bench: the launcher's CONFIG_NAME, the name of srt-slurm's result "
            "folder.",
            show_default=False,
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder to write the result files in.")] = Path("."),
    via: ViaOpt = "frontend",
    tool: Annotated[Tool, typer.Option(help="Which tool wrote the output.")] = "sa-bench",
    concurrency: Annotated[
        int | None,
        typer.Option(min=1, help="With aiperf: the run's concurrency, when its export omits it."),
    ] = None,
    threshold: ThresholdOpt = FAILED_REQUEST_THRESHOLD,
) -> None:
    """Judge a benchmark's output, then write it as InferenceX's result files.

    As InferenceX's workflow would. sa-bench: the copy named by RESULT_FILENAME and its agg_
    file. aiperf: the agentic aggregate <RESULT_FILENAME>_conc<N>.json that InferenceX's
    process_agentic_result.py writes. The run's metadata comes from InferenceX's own variables
    (EXP_NAME, PRECISION, FRAMEWORK, RUNNER_TYPE, RUNNER_NAME, MODEL_PREFIX, IMAGE,
    SPEC_DECODING, ISL, OSL, DISAGG, CONC_LIST, PREFILL_*/DECODE_* NUM_WORKERS, TP, EP, DP_ATTN,
    PP_SIZE, DCP_SIZE, PCP_SIZE, RECIPE_FINGERPRINT; with aiperf also MODEL, KV_OFFLOADING,
    KV_OFFLOAD_BACKEND(_METADATA), ROUTER_METADATA, KV_P2P_TRANSFER, TOTAL_CPU_DRAM_GB)."""
    if tool == "aiperf":
        _write_agentic(raw, url, out, via, concurrency, threshold)
        return
    if config_name is None:
        raise fail("--config-name is needed with sa-bench: the launcher's CONFIG_NAME")
    try:
        shape = RunShape.from_env(inherited())
        parsed, latencies = read_sa_bench(raw)
        result = sa_bench_result(parsed, latencies, url=url, via=via)
    except InputError as exc:
        raise fail(str(exc)) from None
    _judged(result, threshold)
    try:
        written = write_concurrency(raw, parsed, latencies, shape, out, config_name)
    except InputError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write the result files to {out}: {exc.strerror or exc}", 1) from None
    typer.echo(f"wrote {written.result}")
    typer.echo(f"wrote {written.agg}")


def _write_agentic(
    raw: Path, url: str, out: Path, via: Via, concurrency: int | None, threshold: float
) -> None:
    """aiperf's run judged on its aggregate export, then its agentic aggregate written."""
    artifacts = raw if raw.is_dir() else raw.parent
    try:
        job = AgenticJob.from_env(inherited())
        export = read_aiperf(artifacts / AGGREGATE_FILE)
        result = aiperf_result(export, concurrency=concurrency, url=url, via=via)
    except InputError as exc:
        raise fail(str(exc)) from None
    _judged(result, threshold)
    try:
        written = write_agentic(artifacts, job, out, result.concurrency, inherited())
    except InputError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write the agentic result to {out}: {exc.strerror or exc}", 1) from None
    typer.echo(f"wrote {written}")
