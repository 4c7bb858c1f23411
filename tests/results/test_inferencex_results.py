"""Benchmark results in InferenceX's format: InferenceX's own scripts accept what slurmgate writes,
and a result that served nothing or failed too often is refused with its reason."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurmgate.cli.app import run
from slurmgate.runtime.results.inferencex import GpuSplit, RunShape, process_env
from slurmgate.runtime.results.judge import FAILED_REQUEST_THRESHOLD, judge
from slurmgate.runtime.results.raw import (
    MAX_RAW_BYTES,
    aiperf_result,
    read_aiperf,
    read_sa_bench,
    sa_bench_result,
)
from slurmgate.runtime.results.records import read_records

REPO = Path(__file__).resolve().parents[2]
INFERENCEX = REPO / "tests" / "data" / "inferencex-results" / "utils"
BENCH = REPO / "tests" / "data" / "results" / "vllm-bench"
SERVED = BENCH / "results_concurrency_4_gpus_12_ctx_4_gen_8.json"
FAILING = BENCH / "results_concurrency_8_gpus_12_ctx_4_gen_8.json"
AIPERF = REPO / "tests" / "data" / "results" / "aiperf"
URL = "http://10.0.0.5:8000"

# One disaggregated job as InferenceX's multi-node workflow exports it: 1 prefill worker of TP 4
# and 1 decode worker of TP 8, the 4 + 8 GPUs the fixtures' names carry.
JOB = {
    "EXP_NAME": "dsr1_1k1k",
    "PRECISION": "fp4",
    "FRAMEWORK": "dynamo-sglang",
    "RUNNER_TYPE": "gb200",
    "RUNNER_NAME": "gb200-nv_0",
    "MODEL_PREFIX": "dsr1",
    "IMAGE": "lmsysorg/sglang:v0.5.4",
    "SPEC_DECODING": "none",
    "ISL": "1024",
    "OSL": "1024",
    "DISAGG": "true",
    "CONC_LIST": "4 8",
    "RECIPE_FINGERPRINT": "0123456789abcdef0123456789abcdef",
    "PREFILL_NUM_WORKERS": "1",
    "PREFILL_TP": "4",
    "PREFILL_EP": "4",
    "PREFILL_DP_ATTN": "true",
    "DECODE_NUM_WORKERS": "1",
    "DECODE_TP": "8",
    "DECODE_EP": "8",
    "DECODE_DP_ATTN": "true",
}


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """InferenceX's job variables in this process (the command reads them), and a reports
    directory handed as a run hands it; returns that directory."""
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    reports = tmp_path / "reports"
    monkeypatch.setenv("SLURMGATE_RUN_REPORTS_DIR", str(reports))
    return reports


def sed(expression: str, text: str) -> str:
    """The workflow's own extraction, by sed, of a token of a result file's name."""
    done = subprocess.run(["sed", "-n", expression], input=text, capture_output=True, text=True)
    return done.stdout.strip()


def run_inferencex(script: str, *args: str, cwd: Path, env: dict[str, str]):
    return subprocess.run(
        [sys.executable, str(INFERENCEX / script), *args],
        cwd=cwd,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_process_result_accepts_the_written_files_and_agrees_with_our_agg(
    job_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = run(
        ["results", "write", str(SERVED), "--url", URL, "--config-name", "1p1d", "--out", str(out)]
    )
    assert code == 0, capsys.readouterr().err
    [agg] = sorted(out.glob("agg_*.json"))
    [result] = sorted(p for p in out.glob("*.json") if not p.name.startswith("agg_"))
    assert result.read_bytes() == SERVED.read_bytes()
    # the workflow's RESULT_FILENAME, then the launcher's _<config>_conc<N>_gpus_..._gen_<D>
    assert result.name == (
        "dsr1_1k1k_fp4_dynamo-sglang_prefill-tp4-pp1-dcp1-pcp1-ep4-dptrue-nw1"
        "_decode-tp8-pp1-dcp1-pcp1-ep8-dptrue-nw1_disagg-true_spec-none_conc4x8_gb200-nv_0"
        "_recipe-0123456789abcdef_1p1d_conc4_gpus_12_ctx_4_gen_8.json"
    )

    # The "Process result" step, as benchmark-multinode-tmpl.yml runs it on each result file.
    judge_dir = tmp_path / "inferencex"
    judge_dir.mkdir()
    shutil.copy(result, judge_dir / result.name)
    prefill_gpus = sed(r"s/.*_ctx_\([0-9]*\).*\.json/\1/p", result.name)
    decode_gpus = sed(r"s/.*_gen_\([0-9]*\).*\.json/\1/p", result.name)
    assert sed(r"s/.*_gpus_\([0-9][0-9]*\).*\.json/\1/p", result.name) == "12"
    env = {
        **JOB,
        "RESULT_FILENAME": result.name.removesuffix(".json"),
        "IS_MULTINODE": "true",
        "PREFILL_GPUS": prefill_gpus,
        "DECODE_GPUS": decode_gpus,
    }
    done = run_inferencex("process_result.py", cwd=judge_dir, env=env)
    assert done.returncode == 0, done.stderr
    theirs = json.loads((judge_dir / agg.name).read_text())
    ours = json.loads(agg.read_text())
    assert ours == theirs
    assert theirs["conc"] == 4 and theirs["num_decode_gpu"] == 8 and theirs["model"] == "tiny"
    raw = json.loads(SERVED.read_text())
    assert theirs["median_ttft"] == pytest.approx(raw["median_ttft_ms"] / 1000)
    assert theirs["tput_per_gpu"] == pytest.approx(raw["total_token_throughput"] / 12)

    # the environment the product would hand process_result.py is the workflow's
    shape = RunShape.from_env(JOB)
    split = GpuSplit.from_sa_bench_name(SERVED.name)
    assert split is not None
    handed = process_env(shape, env["RESULT_FILENAME"], split)
    assert {k: v for k, v in handed.items() if k in env} == {
        k: v for k, v in env.items() if k in handed
    }
    assert {k: v for k, v in handed.items() if k not in env} == {
        f"{role}_{size}_SIZE": "1"
        for role in ("PREFILL", "DECODE")
        for size in ("PP", "DCP", "PCP")
    }

    # collect_results.py joins the agg_ files into the experiment's list
    collect = tmp_path / "collect"
    (collect / "bmk").mkdir(parents=True)
    shutil.copy(agg, collect / "bmk" / agg.name)
    done = run_inferencex("collect_results.py", "bmk", "sweep", cwd=collect, env={})
    assert done.returncode == 0, done.stderr
    assert json.loads((collect / "agg_sweep.json").read_text()) == [ours]

    # the record is left for the run's artifacts, measured at the frontend
    [record], skipped = read_records(job_env)
    assert skipped == []
    assert (record.concurrency, record.measured_via, record.measured_url) == (4, "frontend", URL)
    assert record.ttft is not None and record.ttft.p99 == pytest.approx(raw["p99_ttft_ms"] / 1e3)


def test_an_error_rate_above_inferencex_bound_is_refused_and_nothing_is_written(
    job_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = json.loads(FAILING.read_text())
    assert (raw["completed"], raw["failed"]) == (28, 12)
    out = tmp_path / "out"
    code = run(
        ["results", "write", str(FAILING), "--url", URL, "--config-name", "1p1d", "--out", str(out)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.splitlines() == [err]
    assert "request error rate 12/40 = 30.000% is above InferenceX's bound of 10.000%" in err
    assert not out.exists()
    # the same file passes with a bound above its rate: the bound, not the file, refused it
    assert run(["results", "judge", str(FAILING), "--url", URL, "--threshold", "0.3"]) == 0


def test_the_bound_is_inferencex_validator_on_the_same_counts(tmp_path: Path) -> None:
    """InferenceX's validator and slurmgate's judge agree, at the bound and just past it."""
    for failed, completed in ((10, 90), (11, 89)):
        folder = tmp_path / f"f{failed}"
        folder.mkdir()
        export = {
            "request_count": {"unit": "requests", "avg": completed},
            "error_request_count": {"unit": "requests", "avg": failed},
            "output_token_throughput": {"unit": "tokens/sec", "avg": 100.0},
            "total_output_tokens": {"unit": "tokens", "avg": 1000.0},
        }
        (folder / "profile_export_aiperf.json").write_text(json.dumps(export))
        done = run_inferencex(
            "agentic/validation/validate_agentic_result.py",
            str(folder),
            "--failed-request-threshold",
            str(FAILED_REQUEST_THRESHOLD),
            cwd=tmp_path,
            env={},
        )
        code = run(
            [
                "results",
                "judge",
                str(folder / "profile_export_aiperf.json"),
                "--tool",
                "aiperf",
                "--concurrency",
                "16",
                "--url",
                URL,
            ]
        )
        assert (done.returncode == 0) == (code == 0) == (failed == 10), done.stderr


@pytest.mark.parametrize("run_name, failed, finished", [("served", 0, 16), ("failing", 12, 40)])
def test_real_aiperf_exports_are_judged_as_inferencex_validator_judges_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run_name: str, failed: int, finished: int
) -> None:
    folder = AIPERF / run_name
    export = json.loads((folder / "profile_export_aiperf.json").read_text())
    done = run_inferencex(
        "agentic/validation/validate_agentic_result.py",
        str(folder),
        "--failed-request-threshold",
        str(FAILED_REQUEST_THRESHOLD),
        cwd=tmp_path,
        env={},
    )
    path = folder / "profile_export_aiperf.json"
    code = run(["results", "judge", str(path), "--url", URL, "--tool", "aiperf"])
    out = capsys.readouterr()
    assert (done.returncode == 0) == (code == 0) == (failed == 0), done.stderr
    assert f"{failed}/{finished} = " in (out.out if code == 0 else out.err)
    result = aiperf_result(read_aiperf(path), concurrency=None, url=URL, via="slurmgate")
    assert result.concurrency == export["input_config"]["phases"][0]["concurrency"]
    assert result.ttft is not None
    assert result.ttft.p99 == pytest.approx(export["time_to_first_token"]["p99"] / 1e3)
    assert result.total_token_throughput == export["total_token_throughput"]["avg"]


def test_a_result_that_served_no_output_token_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = json.loads(SERVED.read_text())
    raw |= {"total_output_tokens": 0, "output_throughput": 0.0}
    raw["total_token_throughput"] = raw["total_input_tokens"] / raw["duration"]
    path = tmp_path / SERVED.name
    path.write_text(json.dumps(raw))
    assert run(["results", "judge", str(path), "--url", URL]) == 1
    err = capsys.readouterr().err
    assert "served 0 output tokens in 16 completed requests" in err

    raw |= {"completed": 0, "failed": 16, "total_input_tokens": 0}
    path.write_text(json.dumps(raw))
    parsed, latencies = read_sa_bench(path)
    verdict = judge(sa_bench_result(parsed, latencies, url=URL, via="slurmgate"))
    assert not verdict.ok and "no request completed (16 finished, all failed)" in verdict.reason


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"completed": "16"}, "field completed"),
        ({"max_concurrency": 4.5}, "field max_concurrency"),
        ({"p99_ttft_ms": "fast"}, "field p99_ttft_ms"),
        ({"mean_e2el_ms": -1.0}, "field mean_e2el_ms"),
        ({"total_output_tokens": None}, "field total_output_tokens"),
        ({"completed": 17}, "field completed"),
        ({"errors": [1, 2]}, "field errors.0"),
    ],
)
def test_a_wrongly_typed_field_is_refused_by_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, object], named: str
) -> None:
    raw = json.loads(SERVED.read_text()) | edit
    path = tmp_path / SERVED.name
    path.write_text(json.dumps(raw))
    assert run(["results", "judge", str(path), "--url", URL]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: sa-bench result") and named in err and "\n" not in err


def test_nan_huge_and_non_object_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = SERVED.read_text()
    raw = json.loads(text)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(raw | {"mean_ttft_ms": math.nan}))  # json.dumps writes NaN
    assert "NaN" in nan.read_text()
    assert run(["results", "judge", str(nan), "--url", URL]) == 2
    assert "NaN is not a number JSON allows" in capsys.readouterr().err

    aiperf_nan = tmp_path / "profile_export_aiperf.json"
    aiperf_nan.write_text('{"request_count": {"unit": "requests", "avg": Infinity}}')
    args = ["--tool", "aiperf", "--concurrency", "1", "--url", URL]
    assert run(["results", "judge", str(aiperf_nan), *args]) == 2
    assert "Infinity is not a number JSON allows" in capsys.readouterr().err

    huge = tmp_path / "huge.json"
    with huge.open("wb") as handle:  # sparse: refused by its size, never read
        handle.truncate(MAX_RAW_BYTES + 1)
    assert run(["results", "judge", str(huge), "--url", URL]) == 2
    assert f"{MAX_RAW_BYTES + 1} bytes is more than" in capsys.readouterr().err

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert run(["results", "judge", str(listed), "--url", URL]) == 2
    assert "holds a list, not a JSON object" in capsys.readouterr().err

    wrong_metric = tmp_path / "aiperf" / "profile_export_aiperf.json"
    wrong_metric.parent.mkdir()
    wrong_metric.write_text(json.dumps({"request_count": {"unit": "requests", "avg": "9"}}))
    assert run(["results", "judge", str(wrong_metric), *args]) == 2
    assert "field request_count.avg" in capsys.readouterr().err


@pytest.mark.parametrize(
    "unset, named",
    [("CONC_LIST", "CONC_LIST is not set"), ("PREFILL_TP", "PREFILL_TP is not set")],
)
def test_a_missing_job_variable_is_named(
    job_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    unset: str,
    named: str,
) -> None:
    monkeypatch.delenv(unset)
    args = ["--url", URL, "--config-name", "1p1d", "--out", str(tmp_path)]
    assert run(["results", "write", str(SERVED), *args]) == 2
    assert named in capsys.readouterr().err


def test_an_aggregated_result_is_named_and_counted_as_the_workflow_does(
    job_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sa-bench names an aggregated run's file without _ctx_/_gen_; the workflow then counts
    every GPU as prefill's, and process_result.py drops decode's parallelism."""
    for name, value in {"DISAGG": "false", "DECODE_NUM_WORKERS": "0", "PREFILL_TP": "8"}.items():
        monkeypatch.setenv(name, value)
    raw = tmp_path / "results_concurrency_4_gpus_8.json"
    shutil.copy(SERVED, raw)
    out = tmp_path / "out"
    args = ["--url", URL, "--via", "slurmgate", "--config-name", "agg", "--out", str(out)]
    assert run(["results", "write", str(raw), *args]) == 0
    [agg] = sorted(out.glob("agg_*.json"))
    result = out / agg.name.removeprefix("agg_")
    assert result.name.endswith("_agg_conc4_gpus_8.json")
    assert sed(r"s/.*_ctx_\([0-9]*\).*\.json/\1/p", result.name) == ""

    judge_dir = tmp_path / "inferencex"
    judge_dir.mkdir()
    shutil.copy(result, judge_dir / result.name)
    env = {
        **JOB,
        "DISAGG": "false",
        "DECODE_NUM_WORKERS": "0",
        "PREFILL_TP": "8",
        "RESULT_FILENAME": result.name.removesuffix(".json"),
        "IS_MULTINODE": "true",
        "PREFILL_GPUS": sed(r"s/.*_gpus_\([0-9][0-9]*\).*\.json/\1/p", result.name),
        "DECODE_GPUS": "0",
    }
    done = run_inferencex("process_result.py", cwd=judge_dir, env=env)
    assert done.returncode == 0, done.stderr
    theirs = json.loads((judge_dir / agg.name).read_text())
    assert json.loads(agg.read_text()) == theirs
    assert (theirs["num_prefill_gpu"], theirs["num_decode_gpu"], theirs["decode_tp"]) == (8, 0, 0)
    assert theirs["disagg"] is False
    [record], _ = read_records(job_env)
    assert record.measured_via == "slurmgate"
