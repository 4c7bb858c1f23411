"""`slurmgate bench`: srt-slurm's sa-bench and AIPerf run for real, per concurrency, on loopback.

sa-bench (slurmgate/data/sa-bench, from `.venv-sabench`) runs against Dynamo's real frontend over
an aggregated mocker worker (`.venv-dynamo`, the helpers of test_dynamo_mocker.py) with the tiny
model's tokenizer; AIPerf (`.venv-aiperf`) replays a Weka trace written here, in the corpus's
format, against slurmgate's stub server, whose failure knobs also make a deployment that answers
only errors. The two tool venvs come from scripts/setup.sh with SLURMGATE_WITH_BENCH_TOOLS=1
(scripts/test.sh sets it). Each tool process takes 15-30 s on two busy cores (transformers'
import), so each test runs one or two of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from slurmgate.runtime.engines.mocker import FileDiscovery
from slurmgate.runtime.results.records import read_records
from slurmgate.testbed.localproc import free_port, stop_group

from ..results.test_agentic_results import AGENTIC_JOB, inferencex_aggregate
from .test_dynamo_mocker import DYNAMO_PYTHON, MODEL, serve, stack, write_tiny_model

REPO = Path(__file__).resolve().parents[2]
SABENCH_PYTHON = REPO / ".venv-sabench" / "bin" / "python"
AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
TOKEN = "sg-bench-secret-token"
NO_TOOLS = "scripts/setup.sh with SLURMGATE_WITH_BENCH_TOOLS=1 makes it (scripts/test.sh does)"
needs_sabench = pytest.mark.skipif(not SABENCH_PYTHON.exists(), reason=f".venv-sabench: {NO_TOOLS}")
needs_aiperf = pytest.mark.skipif(not AIPERF.exists(), reason=f".venv-aiperf: {NO_TOOLS}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model directory, written with the `tokenizers` of whichever venv is here."""
    python = next((p for p in (SABENCH_PYTHON, DYNAMO_PYTHON) if p.exists()), None)
    if python is None:
        pytest.skip(f"no venv with `tokenizers`: {NO_TOOLS}")
    return write_tiny_model(python, tmp_path_factory.mktemp("model") / MODEL)


def bench(
    *args: str, results: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`slurmgate bench ...` as the client step runs it, the endpoint's token in its env."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURMGATE_ENDPOINT_TOKEN": TOKEN, **(env or {})}
    env["SLURMGATE_RESULTS_DIR"] = str(results)
    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", "bench", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def no_secret_in(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert TOKEN not in path.read_text(errors="replace"), path


@pytest.fixture
def stub() -> Iterator[Callable[..., str]]:
    """Starts stub servers: stub(*knobs) is a base URL; every one is stopped at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*knobs: str) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "slurmgate.testbed.stub_server", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--served-model-name", MODEL, *knobs]
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("the stub server did not come up within 30 s")

    try:
        yield start
    finally:
        for proc in procs:
            stop_group(proc, timeout=10)


@needs_sabench
@pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason=f".venv-dynamo: {NO_TOOLS}")
def test_sa_bench_saves_a_result_per_concurrency_from_dynamo(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    with stack(tmp_path / "dynamo") as s:
        (tmp_path / "dynamo").mkdir(exist_ok=True)
        serving = serve(s, FileDiscovery(str(tmp_path / "kv")), tokenizer_dir, {"worker": "agg"})
        url = f"http://127.0.0.1:{serving.ports['http']}"
        results = tmp_path / "results"
        done = bench(
            "sa-bench", url, "--model", MODEL, "--tokenizer", str(tokenizer_dir),
            "--isl", "64", "--osl", "8", "--concurrencies", "1x2", "--num-prompts-mult", "2",
            "--num-warmup-mult", "0", "--gpus", "4",
            results=results,
            # as a run hands its client: its endpoints, and where the records go
            env={"SLURMGATE_ENDPOINTS": json.dumps({"d": url}),
                 "SLURMGATE_RUN_REPORTS_DIR": str(tmp_path / "reports")},
        )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout[-3000:]
    # each concurrency judged and recorded for the run's artifacts, naming what it measured
    kept, skipped = read_records(tmp_path / "reports")
    assert skipped == []
    assert sorted(r.concurrency for r in kept) == [1, 2]
    assert {(r.tool, r.measured_url, r.measured_via) for r in kept} == {
        ("sa-bench", url, "slurmgate")
    }
    assert all(r.output_throughput > 0 for r in kept)
    assert "measured at " + url in done.stdout
    folder = results / "sa-bench_isl_64_osl_8"
    for c in (1, 2):
        saved = json.loads((folder / f"results_concurrency_{c}_gpus_4.json").read_text())
        assert saved["max_concurrency"] == c
        assert saved["num_prompts"] == 2 * c
        assert saved["completed"] == 2 * c
        # random lengths: between osl × (1 - 0.8) and osl, as sa-bench's range ratio draws them
        assert len(saved["output_lens"]) == 2 * c
        assert all(2 <= n <= 8 for n in saved["output_lens"]), saved["output_lens"]
        assert saved["total_output_tokens"] == sum(saved["output_lens"])
        assert not any(saved["errors"])
    assert sorted(p.name for p in folder.glob("*.json")) == [
        "results_concurrency_1_gpus_4.json",
        "results_concurrency_2_gpus_4.json",
    ]
    no_secret_in(results)


@needs_sabench
def test_sa_bench_fails_with_its_reason_when_the_deployment_answers_errors(
    tokenizer_dir: Path, tmp_path: Path, stub: Callable[..., str]
) -> None:
    url = stub("--fail-status", "500", "--fail-rate", "1.0")
    done = bench(
        "sa-bench", url, "--model", MODEL, "--tokenizer", str(tokenizer_dir), "--isl", "32",
        "--osl", "8", "--concurrencies", "2", "--num-warmup-mult", "0",
        results=tmp_path / "results",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line
    assert line.startswith("error: sa-bench concurrency 2 run exited with 1: ")
    assert "Initial test run failed" in line, line


@needs_aiperf
def test_aiperf_replays_a_weka_trace_per_concurrency(
    tokenizer_dir: Path, tmp_path: Path, stub: Callable[..., str]
) -> None:
    url = stub()
    engine = stub()  # an engine's own /metrics, as AIPERF_SERVER_METRICS_URLS names them
    results = tmp_path / "results"
    done = bench(
        "aiperf", url, "--model", MODEL, "--tokenizer", str(tokenizer_dir),
        "--concurrencies", "2", "--duration", "4", "--stand-in-traces",
        "--env", f"AIPERF_SERVER_METRICS_URLS={engine}/metrics",
        results=results,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout[-3000:]
    # the stand-ins' corpus (--local --bench), in the hub corpus's Weka format: AIPerf reads it
    corpus = results / "stand-in-traces"
    assert len(list(corpus.glob("stand-in-*.json"))) == 4
    artifacts = results / "conc_2" / "aiperf_artifacts"
    export = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert export["total_output_tokens"]["avg"] > 0
    assert (artifacts / "profile_export.jsonl").exists()
    command = (results / "conc_2" / "benchmark_command.txt").read_text()
    assert "--scenario inferencex-agentx-mvp" in command
    assert f"--custom-dataset-type weka_trace --input-file {corpus}" in command
    assert "--concurrency 2 " in command
    assert f"--server-metrics {engine}/metrics --output-artifact-dir" in command
    # both /metrics scraped: the URL's, found by aiperf itself, and the named engine's
    scraped = json.loads((artifacts / "server_metrics_export.json").read_text())
    running = scraped["metrics"]["vllm:num_requests_running"]["series"]
    assert {s["endpoint_url"] for s in running} == {f"{url}/metrics", f"{engine}/metrics"}
    no_secret_in(results)

    # what InferenceX's process_agentic_result.py makes of these artifacts, slurmgate writes
    job = {**AGENTIC_JOB, "CONC_LIST": "2"}
    out = tmp_path / "agentic"
    # the hub cache InferenceX's script is given (no Weka corpus: a local trace was replayed)
    env = {**os.environ, "PYTHONPATH": str(REPO), **job, "HF_HUB_CACHE": str(tmp_path / "hf-hub")}
    written = subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", "results", "write", str(artifacts),
         "--tool", "aiperf", "--url", url, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    [ours] = sorted(out.glob("*.json"))
    theirs_done, theirs = inferencex_aggregate(artifacts, tmp_path, 2, job)
    assert theirs_done.returncode == 0, theirs_done.stderr
    assert json.loads(ours.read_text()) == json.loads(theirs.read_text())
    body = json.loads(ours.read_text())
    assert body["num_requests_successful"] > 0
    assert body["server_metrics"]["adapter"] == "vllm"  # the stub's vLLM gauges


@needs_aiperf
def test_a_hub_corpus_out_of_reach_is_refused_at_once(tokenizer_dir: Path, tmp_path: Path) -> None:
    hub_cache = tmp_path / "hub"
    hub_cache.mkdir()
    started = time.monotonic()
    env_args = ("--env", "WEKA_LOADER_OVERRIDE=semianalysis_cc_traces_weka_062126_256k")
    done = bench(
        "aiperf", "http://127.0.0.1:9", "--model", MODEL, "--tokenizer", str(tokenizer_dir),
        "--concurrencies", "2", *env_args,
        results=tmp_path / "results",
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)},
    )  # fmt: skip
    assert time.monotonic() - started < 45
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line
    assert line.startswith(
        "error: aiperf corpus semianalysis_cc_traces_weka_062126_256k "
        "(semianalysisai/cc-traces-weka-062126-256k) cannot be fetched: HF_HUB_OFFLINE is set and "
    ), line


def test_a_stand_in_corpus_replaces_the_others_and_never_both(tmp_path: Path) -> None:
    done = bench(
        "aiperf", "http://127.0.0.1:9", "--model", MODEL, "--tokenizer", str(tmp_path),
        "--concurrencies", "2", "--stand-in-traces", "--input-file", str(tmp_path),
        results=tmp_path / "results",
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        "error: --stand-in-traces: it replaces --public-dataset and --input-file; give one"
    )
