"""A recipe's benchmark tools as a run's client on the bundled cluster: sa-bench and AIPerf.

The deployment is Dynamo's frontend over a prefill and a decode mocker (`.venv-dynamo`), on a
tiny model written here so the client has its tokenizer; the client runs `slurmgate bench
sa-bench` and then `slurmgate bench aiperf` against the run's logical endpoint, as a recipe's
client command does. A deployment of stubs that answer only errors fails the run with sa-bench's
own reason.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.results.records import read_records
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.from_recipe import spec_from_recipe
from slurmgate.runtime.spec.local_recipe import localize

from ..results.test_agentic_results import AGENTIC_JOB, inferencex_aggregate
from .test_bench_tools import AIPERF, SABENCH_PYTHON
from .test_dynamo_mocker import DYNAMO_PYTHON, MODEL, write_tiny_model

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def _tools_or_skip() -> None:
    missing = [str(p) for p in (SABENCH_PYTHON, AIPERF, DYNAMO_PYTHON) if not p.exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)}: scripts/setup.sh makes them (scripts/test.sh does)")


def _tiny_model(where: Path) -> Path:
    return write_tiny_model(DYNAMO_PYTHON, where)


def _client(model: Path) -> list[str]:
    bench = f"{shlex.quote(sys.executable)} -m slurmgate.cli bench"
    url = '"${OPENAI_BASE_URL%/v1}"'
    common = f"--model {MODEL} --tokenizer {shlex.quote(str(model))}"
    return [
        "sh",
        "-c",
        f"{bench} sa-bench {url} {common} --isl 32 --osl 8 --concurrencies 1x2 "
        f"--num-prompts-mult 2 --num-warmup-mult 0 --gpus 16 "
        f"--python {shlex.quote(str(SABENCH_PYTHON))} && "
        f"{bench} aiperf {url} {common} --concurrencies 2 --duration 4 "
        # the stand-ins' corpus, as `--local --bench` replays an agentic recipe's
        f"--stand-in-traces --cli {shlex.quote(str(AIPERF))}",
    ]


def _spec(model: Path) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "bench",
            "gpus_per_node": 8,
            "time_limit": "00:06:00",
            "client": {"command": _client(model), "dedicated_node": True},
            "deployments": [
                {
                    "name": "dyn",
                    "engine": "dynamo-sglang",
                    "stand_in": "dynamo-mocker",
                    "command": [
                        str(DYNAMO_PYTHON),
                        "-m",
                        "dynamo.mocker",
                        "--model-path",
                        str(model),
                        "--model-name",
                        MODEL,
                    ],
                    "roles": {
                        "prefill": {"args": ["--speedup-ratio", "0"]},
                        "decode": {"args": ["--speedup-ratio", "0"]},
                    },
                    "frontend": {
                        "type": "dynamo",
                        "command": [str(DYNAMO_PYTHON), "-m", "dynamo.frontend"],
                        "discovery": "file",
                        "port": 17840,
                        "startup_timeout_s": 90,
                    },
                    "base_port": 19040,
                    "bootstrap_base_port": 19050,
                    "side_base_port": 21000,
                    "endpoint_port": 17842,
                    "startup_timeout_s": 90,
                    "lead_boot_standoff_s": 0,
                    "rank_launch_stagger_s": 0,
                }
            ],
        },
        source="test",
    )


def test_sa_bench_and_aiperf_write_their_results_through_the_endpoint(
    tmp_path: Path, runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tools_or_skip()
    job = held_allocation(nodes=3, gpus=8)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    model = _tiny_model(tmp_path / "model")
    run = AllocationRun(_spec(model), runs_root=runs_root)
    run.run()
    assert run.status == "succeeded"
    reports = run.run_dir / "client-reports"
    # the raw results, collected from the client host with the run's outputs
    raw = run.run_dir / "outputs" / "client" / "results"
    folder = raw / "sa-bench_isl_32_osl_8"
    for c in (1, 2):
        saved = json.loads((folder / f"results_concurrency_{c}_gpus_16.json").read_text())
        assert saved["max_concurrency"] == c and saved["completed"] == 2 * c
        assert saved["total_output_tokens"] > 0
    export = json.loads(
        (raw / "conc_2" / "aiperf_artifacts" / "profile_export_aiperf.json").read_text()
    )
    assert export["total_output_tokens"]["avg"] > 0
    assert len(list((raw / "stand-in-traces").glob("stand-in-*.json"))) == 4
    scraped = json.loads(
        (raw / "conc_2" / "aiperf_artifacts" / "server_metrics_export.json").read_text()
    )
    # the run hands its client the frontend's and each mocker's /metrics; AIPerf scraped them
    successful = scraped["summary"]["endpoints_successful"]
    assert any(u.endswith(":17840/metrics") for u in successful), successful
    lanes = [u for u in successful if not u.endswith((":17840/metrics", ":17842/metrics"))]
    assert len(lanes) == 2, successful
    assert any(name.startswith("dynamo_") for name in scraped["metrics"]), list(scraped["metrics"])
    # and from these artifacts slurmgate writes InferenceX's agentic aggregate, as its own
    # process_agentic_result.py does, with the engines' figures from Dynamo's metrics
    artifacts = raw / "conc_2" / "aiperf_artifacts"
    job = {**AGENTIC_JOB, "FRAMEWORK": "dynamo-sglang", "CONC_LIST": "2"}
    env = {**os.environ, "PYTHONPATH": str(REPO), **job, "HF_HUB_CACHE": str(tmp_path / "hf")}
    written = subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", "results", "write", str(artifacts),
         "--tool", "aiperf", "--url", "http://endpoint", "--out", str(tmp_path / "agentic")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    [ours] = sorted((tmp_path / "agentic").glob("*.json"))
    theirs_done, theirs = inferencex_aggregate(artifacts, tmp_path, 2, job)
    assert theirs_done.returncode == 0, theirs_done.stderr
    assert json.loads(ours.read_text()) == json.loads(theirs.read_text())
    assert json.loads(ours.read_text())["server_metrics"]["adapter"] == "dynamo-vllm"
    kept, skipped = read_records(reports)
    assert skipped == []
    assert sorted((r.tool, r.concurrency) for r in kept) == [
        ("aiperf", 2),
        ("sa-bench", 1),
        ("sa-bench", 2),
    ]
    # measured through the run's logical endpoint (its port), which the record names
    assert {r.measured_via for r in kept} == {"slurmgate"}
    assert {r.measured_url.rsplit(":", 1)[-1] for r in kept} == {"17842"}


def test_a_deployment_that_answers_errors_fails_the_run_with_sa_benchs_reason(
    tmp_path: Path, runs_root: Path, held_allocation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tools_or_skip()
    job = held_allocation(nodes=2, gpus=8)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    model = _tiny_model(tmp_path / "model")
    bench = (
        f"{shlex.quote(sys.executable)} -m slurmgate.cli bench sa-bench "
        f'"${{OPENAI_BASE_URL%/v1}}" --model stub --tokenizer {shlex.quote(str(model))} '
        f"--isl 32 --osl 8 --concurrencies 2 --num-warmup-mult 0 "
        f"--python {shlex.quote(str(SABENCH_PYTHON))}"
    )
    spec = AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "bench-errors",
            "gpus_per_node": 8,
            "time_limit": "00:04:00",
            "client": {"command": ["sh", "-c", bench], "dedicated_node": True},
            "deployments": [
                {
                    "name": "stub",
                    "command": [
                        sys.executable,
                        "-m",
                        "slurmgate.testbed.stub_server",
                        "--fail-status",
                        "500",
                        "--fail-rate",
                        "1.0",
                    ],
                    "base_port": 19140,
                    "endpoint_port": 17942,
                    "startup_timeout_s": 60,
                    "distributed_timeout_s": 30,
                }
            ],
        },
        source="test",
    )
    run = AllocationRun(spec, runs_root=runs_root)
    with pytest.raises(RunFailed) as info:
        run.run()
    message = str(info.value)
    assert "client" in message and "Initial test run failed" in message, message[-3000:]
    assert run.cleaned and run.status == "failed"


def test_a_local_recipe_run_benchmarks_its_stand_ins_with_the_recipes_sa_bench(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`allocation run --recipe R --local --bench`: the recipe's own sa-bench, scaled down,
    through Dynamo's frontend over the mockers, with the stand-in's tiny tokenizer."""
    _tools_or_skip()
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    recipe = (
        REPO / "tests/data/srt-slurm-recipes/trtllm/h200/8k1k/stp"
        / "c8_ctx1_gen6_tep8_batch16_eplb0_mtp0.yaml"
    )  # fmt: skip
    local = localize(spec_from_recipe(recipe), dynamo_python=str(DYNAMO_PYTHON), bench=True)
    run = AllocationRun(local.spec, runs_root=runs_root)
    run.run()
    assert run.status == "succeeded"
    raw = run.run_dir / "outputs" / "client" / "results" / "sa-bench_isl_64_osl_16"
    saved = json.loads((raw / "results_concurrency_4_gpus_56_ctx_8_gen_48.json").read_text())
    assert saved["completed"] == 8 and saved["total_output_tokens"] > 0
    kept, _ = read_records(run.run_dir / "client-reports")
    assert [(r.tool, r.concurrency, r.measured_via) for r in kept] == [("sa-bench", 4, "slurmgate")]
