"""A recipe's benchmark tools as a run's client on the bundled cluster: sa-bench and AIPerf.

The deployment is Dynamo's frontend over a prefill and a decode mocker (`.venv-dynamo`), on a
tiny model written here so the client has its tokenizer; the client runs `slurmgate bench
sa-bench` and then `slurmgate bench aiperf` against the run's logical endpoint, as a recipe's
client command does. A deployment of stubs that answer only errors fails the run with sa-bench's
own reason.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.benchmarks.aiperf import write_stand_in_traces
from slurmgate.runtime.results.records import read_records
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.from_recipe import spec_from_recipe
from slurmgate.runtime.spec.local_recipe import localize

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


def _client(model: Path, traces: Path) -> list[str]:
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
        f"--input-file {shlex.quote(str(traces))} --cli {shlex.quote(str(AIPERF))}",
    ]


def _spec(model: Path, traces: Path) -> AllocationSpec:
    return AllocationSpec.from_data(
        {
            "schema_version": 1,
            "name": "bench",
            "gpus_per_node": 8,
            "time_limit": "00:06:00",
            "client": {"command": _client(model, traces), "dedicated_node": True},
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
    run = AllocationRun(
        _spec(model, write_stand_in_traces(tmp_path / "traces", MODEL)), runs_root=runs_root
    )
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


def test_a_local_agentic_recipe_run_replays_its_stand_in_corpus_with_aiperf(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`allocation run --recipe R --local --bench` for InferenceX's agentic replay: AIPerf over
    the stand-in corpus, through the endpoint in front of Dynamo's frontend and the mockers."""
    _tools_or_skip()
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    recipe = (
        REPO / "tests/data/inferencex-branch-recipes/benchmarks/multi_node/srt-slurm-recipes"
        / "trtllm/deepseek-v4/agentx-gb300-20260811"
        / "dynamo-disagg-gb300-1p4d-dep4-tep8-c4-b1-mtp.yaml"
    )  # fmt: skip
    local = localize(spec_from_recipe(recipe), dynamo_python=str(DYNAMO_PYTHON), bench=True)
    run = AllocationRun(local.spec, runs_root=runs_root)
    run.run()
    assert run.status == "succeeded"
    results = run.run_dir / "outputs" / "client" / "results"
    assert len(list((results / "stand-in-traces").glob("stand-in-*.json"))) == 4
    export = results / "conc_4" / "aiperf_artifacts" / "profile_export_aiperf.json"
    assert json.loads(export.read_text())["total_output_tokens"]["avg"] > 0
    kept, _ = read_records(run.run_dir / "client-reports")
    assert [(r.tool, r.concurrency, r.measured_via) for r in kept] == [("aiperf", 4, "slurmgate")]
    assert kept[0].requests_failed == 0 and kept[0].total_output_tokens > 0
