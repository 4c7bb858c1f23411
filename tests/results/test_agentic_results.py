"""The agentic aggregate: InferenceX's process_agentic_result.py and slurmgate's writer make the
same file from the same AIPerf exports, InferenceX's checks accept it, and bad exports are
refused in one line naming the file and field."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.cli.app import run
from slurmgate.runtime.results.agentic import AgenticJob
from slurmgate.runtime.results.records import read_records

from .test_inferencex_results import AIPERF, JOB, URL

INFERENCEX_ROOT = Path(__file__).resolve().parents[1] / "data" / "inferencex-results"
AGENTIC = AIPERF / "agentic"
PROCESS = "utils.agentic.aggregation.process_agentic_result"
THRESHOLD = "0.10"  # AIPERF_FAILED_REQUEST_THRESHOLD in InferenceX's workflows
# The agentic variables InferenceX's multi-node template exports beside the job's shape; the
# fixtures replayed a Weka trace at concurrency 2 against the stub engine (vLLM's gauges)
AGENTIC_JOB = {
    **JOB,
    "FRAMEWORK": "vllm",
    "CONC_LIST": "2",
    "MODEL": "tiny",
    "KV_OFFLOADING": "none",
    "TOTAL_CPU_DRAM_GB": "600",
}


@pytest.fixture
def agentic_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name, value in AGENTIC_JOB.items():
        monkeypatch.setenv(name, value)
    reports = tmp_path / "reports"
    monkeypatch.setenv("SLURMGATE_RUN_REPORTS_DIR", str(reports))
    # the hub cache InferenceX's script is given too: no Weka corpus unless a test puts one
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    return reports


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def inferencex_aggregate(
    artifacts: Path, tmp_path: Path, concurrency: int, job: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """InferenceX's process_agentic_result.py on a copy of ``artifacts``, as
    write_agentic_result_json runs it for one concurrency of agentic_srt.sh under the
    multi-node template; returns the process and the file it writes."""
    result_dir = tmp_path / "inferencex" / f"conc_{concurrency}"
    shutil.copytree(artifacts, result_dir / "aiperf_artifacts")
    output = tmp_path / "inferencex" / "workspace"
    name = f"{AgenticJob.from_env(job).shape.result_filename()}_conc{concurrency}"
    hub = tmp_path / "hf-hub"  # where a test puts a Weka corpus, if any
    hub.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        **job,
        "IS_MULTINODE": "true",
        "CONC": str(concurrency),
        "RESULT_FILENAME": name,
        "RESULT_DIR": str(result_dir),
        "AGENTIC_OUTPUT_DIR": str(output),
        "HF_HUB_CACHE": str(hub),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", PROCESS],
        cwd=INFERENCEX_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done, output / f"{name}.json"


def validate(artifacts: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(INFERENCEX_ROOT / "utils/agentic/validation/validate_agentic_result.py"),
            str(artifacts),
            "--failed-request-threshold",
            THRESHOLD,
        ],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def write(artifacts: Path, out: Path, *extra: str) -> int:
    args = ["--tool", "aiperf", "--url", URL, "--out", str(out), *extra]
    return run(["results", "write", str(artifacts), *args])


@pytest.mark.parametrize("run_name, threshold", [("served", THRESHOLD), ("failing", "0.5")])
def test_inferencex_and_slurmgate_write_the_same_agentic_aggregate(
    agentic_env: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    run_name: str,
    threshold: str,
) -> None:
    artifacts = AGENTIC / run_name
    out = tmp_path / "out"
    assert write(artifacts, out, "--threshold", threshold) == 0, capsys.readouterr().err
    [ours] = sorted(out.glob("*.json"))

    done, theirs_path = inferencex_aggregate(artifacts, tmp_path, 2, AGENTIC_JOB)
    assert done.returncode == 0, done.stderr
    assert theirs_path.name == ours.name
    # the multi-node template's own check: one <RESULT_FILENAME>_conc*.json per concurrency
    base = AgenticJob.from_env(AGENTIC_JOB).shape.result_filename()
    assert [p.name for p in out.glob(f"{base}_conc*.json")] == [ours.name]
    theirs = json.loads(theirs_path.read_text())
    assert json.loads(ours.read_text()) == theirs
    assert ours.read_text() == theirs_path.read_text() + "\n"

    # the figures, from the per-request export itself
    rows = lines(artifacts / "profile_export.jsonl")
    profiled = [r for r in rows if r["metadata"].get("benchmark_phase") == "profiling"]
    measured = [r for r in profiled if not r.get("error")]
    assert theirs["num_requests_total"] == len(rows)
    assert theirs["num_requests_successful"] == len(measured) > 0
    accounting = theirs["request_accounting"]
    assert accounting["records_error_dropped"] == sum(1 for r in rows if r.get("error"))
    assert accounting["records_warmup_dropped"] == len(rows) - len(profiled)
    assert (accounting["records_error_dropped"] > 0) == (run_name == "failing")
    starts = min(r["metadata"]["request_start_ns"] for r in measured)
    ends = max(r["metadata"]["request_end_ns"] for r in measured)
    tokens = sum(
        r["metrics"][k]["value"]
        for r in measured
        for k in ("input_sequence_length", "output_sequence_length")
    )
    throughput = theirs["request_metrics"]["throughput"]
    assert throughput["total"]["tokens_per_second"] == pytest.approx(
        tokens / ((ends - starts) / 1e9), rel=1e-4
    )
    assert throughput["per_gpu"]["total_tput_tps"] == pytest.approx(
        throughput["total"]["tokens_per_second"] / 12, rel=1e-3
    )
    assert theirs["server_metrics"]["adapter"] == "vllm"  # the stub's vllm: gauges
    assert (theirs["conc"], theirs["num_prefill_gpu"], theirs["num_decode_gpu"]) == (2, 4, 8)
    assert theirs["scenario_type"] == "agentic-coding" and theirs["is_multinode"] is True

    # InferenceX's validator and slurmgate's judge agree on the same run
    checked = validate(artifacts, tmp_path)
    assert (checked.returncode == 0) == (run_name == "served"), checked.stdout + checked.stderr
    assert write(artifacts, tmp_path / "judged") == (0 if run_name == "served" else 1)
    [record, *_] = read_records(agentic_env)[0]
    assert (record.tool, record.concurrency) == ("aiperf", 2)


def test_expected_output_lengths_come_from_the_cached_weka_corpus(
    agentic_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the replayed corpus in the hub cache (where `slurmgate bench aiperf` fetches it),
    both writers add each measured request's recorded output length."""
    snapshot = tmp_path / "hf-hub" / "datasets--semianalysisai--cc-traces-weka-062126"
    snapshot = snapshot / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i in range(4):  # the fixtures' four traces, each turn with its own output length
        turns = [{"type": "s", "in": 64, "out": 10 * (i + 1) + turn} for turn in range(4)]
        trace = {"id": f"trace-{i}", "requests": turns}
        (snapshot / f"trace-{i}.json").write_text(json.dumps(trace))
    artifacts = AGENTIC / "served"
    out = tmp_path / "out"
    assert write(artifacts, out) == 0, capsys.readouterr().err
    [ours] = sorted(out.glob("*.json"))
    done, theirs_path = inferencex_aggregate(artifacts, tmp_path, 2, AGENTIC_JOB)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(theirs_path.read_text())
    assert json.loads(ours.read_text()) == theirs
    measured = [
        r["metadata"]
        for r in lines(artifacts / "profile_export.jsonl")
        if r["metadata"].get("benchmark_phase") == "profiling" and not r.get("error")
    ]
    expected = [
        10 * (int(m["conversation_id"].split("::")[0].rsplit("-", 1)[1]) + 1) + m["turn_index"]
        for m in measured
    ]
    got = theirs["request_metrics"]["tokens"]["output_expected"]
    assert got["mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert max(expected) > min(expected)


def series(stats: dict[str, float], **labels: str) -> dict[str, Any]:
    return {"endpoint_url": "http://10.0.0.7:8000/metrics", "labels": labels, "stats": stats}


def counter(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"type": "counter", "series": list(entries)}


def gauge(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"type": "gauge", "series": list(entries)}


# Exports in aiperf's form of each engine family InferenceX's aggregation knows, with the
# metric names its adapters read (counters: total; gauges: avg, max)
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "vllm": (
        "vllm",
        {
            "vllm:prompt_tokens": counter(series({"total": 5000.0})),
            "vllm:generation_tokens": counter(series({"total": 700.0})),
            "vllm:prefix_cache_hits": counter(
                series({"total": 3000.0}, engine="0"), series({"total": 1000.0}, engine="1")
            ),
            "vllm:prefix_cache_queries": counter(
                series({"total": 4000.0}, engine="0"), series({"total": 4000.0}, engine="1")
            ),
            "vllm:kv_cache_usage_perc": gauge(series({"avg": 0.4, "max": 0.75}, engine="0")),
            "vllm:kv_offload_bytes_gpu_to_cpu": counter(series({"total": 2.0e9})),
            "vllm:kv_offload_time_gpu_to_cpu": counter(series({"total": 4.0})),
        },
    ),
    "vllm-by-source": (
        "vllm",
        {
            "vllm:prompt_tokens_by_source": counter(
                series({"total": 600.0}, source="local_cache_hit"),
                series({"total": 100.0}, source="external_kv_transfer"),
                series({"total": 300.0}, source="local_compute"),
            ),
            "vllm:gpu_cache_usage_perc": gauge(series({"avg": 30.0, "max": 62.0})),
        },
    ),
    "sglang": (
        "sglang",
        {
            "sglang:prompt_tokens": counter(series({"total": 8000.0})),
            "sglang:generation_tokens": counter(series({"total": 900.0})),
            "sglang:cached_tokens": counter(
                series({"total": 4000.0}, cache_source="device"),
                series({"total": 1000.0}, cache_source="host"),
            ),
            "sglang:token_usage": gauge(series({"avg": 0.2, "max": 0.5})),
            "sglang:max_total_num_tokens": gauge(series({"avg": 65536.0, "max": 65536.0})),
            "sglang:hicache_host_used_tokens": gauge(series({"avg": 10.0, "max": 100.0})),
            "sglang:hicache_host_total_tokens": gauge(series({"avg": 400.0, "max": 400.0})),
            "sglang:realtime_tokens": counter(series({"total": 3000.0}, mode="prefill_compute")),
        },
    ),
    "dynamo-sglang": (
        "dynamo-vllm",
        {
            "dynamo_frontend_input_sequence_tokens": counter(series({"total": 9000.0})),
            "dynamo_frontend_output_tokens": counter(series({"total": 800.0})),
            "dynamo_frontend_cached_tokens": counter(series({"total": 4500.0})),
            "dynamo_component_router_kv_hit_rate": gauge(series({"avg": 40.0, "max": 90.0})),
            "dynamo_component_gpu_cache_usage_percent": gauge(series({"avg": 0.3, "max": 0.6})),
        },
    ),
    "atom": (
        "atom",
        {
            "atom:prompt_tokens_total": counter(series({"total": 1200.0})),
            "atom_prefix_cache_cached_tokens": counter(series({"total": 300.0})),
            "atom_prefix_cache_full_tokens": counter(series({"total": 1200.0})),
            "atom:kv_cache_usage_ratio": gauge(series({"avg": 0.1, "max": 0.2})),
        },
    ),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_engine_family_server_metrics_agree_with_inferencex(
    agentic_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    engine: str,
) -> None:
    framework = "dynamo-sglang" if engine == "dynamo-sglang" else engine.split("-")[0]
    monkeypatch.setenv("FRAMEWORK", framework)
    adapter, metrics = ENGINES[engine]
    artifacts = tmp_path / "aiperf_artifacts"
    shutil.copytree(AGENTIC / "served", artifacts)
    (artifacts / "server_metrics_export.json").write_text(json.dumps({"metrics": metrics}))
    out = tmp_path / "out"
    assert write(artifacts, out) == 0, capsys.readouterr().err
    [ours] = sorted(out.glob("*.json"))
    job = {**AGENTIC_JOB, "FRAMEWORK": framework}
    done, theirs_path = inferencex_aggregate(artifacts, tmp_path, 2, job)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(theirs_path.read_text())
    assert json.loads(ours.read_text()) == theirs
    served = theirs["server_metrics"]
    assert served["adapter"] == adapter and served["metric_count"] == len(metrics)
    cache = served["cache"]
    # one figure each, from the export's numbers
    if engine == "vllm":
        assert cache["gpu_cache_hit_rate"] == pytest.approx(4000 / 8000)
        assert served["kv_offload"]["bandwidth_gpu_to_cpu_bytes_per_second"] == 5.0e8
        # one source per labelled series: the unlabelled token counters, engine 0, engine 1
        rates = {s["id"].rsplit("|", 1)[-1]: s["prefix_cache_hit_rate"] for s in served["sources"]}
        assert rates == {"http://10.0.0.7:8000/metrics": None, "engine=0": 0.75, "engine=1": 0.25}
    elif engine == "vllm-by-source":
        assert cache["overall_cache_hit_rate"] == pytest.approx(700 / 1000)
        assert served["kv_cache"]["gpu_usage_pct"] == pytest.approx(0.62)
    elif engine == "sglang":
        assert cache["cpu_cache_hit_rate"] == pytest.approx(1000 / 8000)
        assert theirs["kv_cache_pool_tokens"] == 65536
    elif engine == "dynamo-sglang":
        assert cache["frontend_cache_hit_rate"] == pytest.approx(0.5)
        assert served["tokens"]["prompt_total"] == 9000
    else:
        assert cache["gpu_cache_hit_rate"] == pytest.approx(0.25)


def test_metrics_of_no_known_engine_are_refused_as_inferencex_refuses_them(
    agentic_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """slurmgate's endpoint exports only its own metrics: without the engines' /metrics,
    InferenceX's script stops, and slurmgate says which variable brings them."""
    artifacts = tmp_path / "aiperf_artifacts"
    shutil.copytree(AGENTIC / "served", artifacts)
    own = {"slurmgate_endpoint_requests": counter(series({"total": 31.0}, endpoint="d"))}
    (artifacts / "server_metrics_export.json").write_text(json.dumps({"metrics": own}))
    done, _ = inferencex_aggregate(artifacts, tmp_path, 2, {**AGENTIC_JOB, "FRAMEWORK": "vllm"})
    assert done.returncode != 0 and "Unsupported agentic server metrics backend" in done.stderr
    out = tmp_path / "out"
    assert write(artifacts, out) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "slurmgate_endpoint_requests" in err
    assert "AIPERF_SERVER_METRICS_URLS" in err
    assert not list(out.glob("*.json"))


def _without_records(folder: Path) -> None:
    (folder / "profile_export.jsonl").unlink()


def _malformed_line(folder: Path) -> None:
    path = folder / "profile_export.jsonl"
    rows = path.read_text().splitlines()
    rows[4] = rows[4][: len(rows[4]) // 2]
    path.write_text("\n".join(rows) + "\n")


def _wrong_field(folder: Path) -> None:
    path = folder / "profile_export.jsonl"
    rows = lines(path)
    rows[2]["metadata"]["request_end_ns"] = "soon"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _bad_server_metrics(folder: Path) -> None:
    (folder / "server_metrics_export.json").write_text('{"metrics": {"vllm:x": {"series": 3}}}')


@pytest.mark.parametrize(
    "spoil, named",
    [
        (_without_records, "profile_export.jsonl: cannot read it"),
        (_malformed_line, "profile_export.jsonl: line 5: not JSON"),
        (_wrong_field, "profile_export.jsonl: line 3: field metadata.request_end_ns"),
        (_bad_server_metrics, "server_metrics_export.json: field metrics.vllm:x.series"),
    ],
)
def test_a_bad_export_is_refused_in_one_line_naming_file_and_field(
    agentic_env: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spoil: Any,
    named: str,
) -> None:
    artifacts = tmp_path / "aiperf_artifacts"
    shutil.copytree(AGENTIC / "served", artifacts)
    spoil(artifacts)
    out = tmp_path / "out"
    assert write(artifacts, out) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: aiperf ") and "\n" not in err, err
    assert named in err, err
    assert not out.exists() or not list(out.glob("*.json"))


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"KV_OFFLOADING": ""}, "KV_OFFLOADING is not set"),
        ({"KV_OFFLOADING": "dram"}, "KV_OFFLOAD_BACKEND and KV_OFFLOAD_BACKEND_METADATA"),
        ({"ROUTER_METADATA": "{"}, "ROUTER_METADATA must hold JSON"),
        ({"TOTAL_CPU_DRAM_GB": "lots"}, "TOTAL_CPU_DRAM_GB='lots'"),
    ],
)
def test_a_bad_job_variable_is_named(
    agentic_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    edit: dict[str, str],
    named: str,
) -> None:
    for name, value in edit.items():
        monkeypatch.setenv(name, value)
    assert write(AGENTIC / "served", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "\n" not in err, err
