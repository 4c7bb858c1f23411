"""The client a recipe-built spec runs: the recipe's own benchmark tool through `slurmgate bench`
(sa-bench, or AIPerf for InferenceX's agentic rows), else a loadgen smoke load, reported why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmgate.errors import InputError
from slurmgate.runtime.spec.from_recipe import Site, spec_from_recipe

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
SA_BENCH = DATA / "srt-slurm-recipes/trtllm/h200/8k1k/stp/c8_ctx1_gen6_tep8_batch16_eplb0_mtp0.yaml"
AGENTX = (
    DATA / "inferencex-branch-recipes/benchmarks/multi_node/srt-slurm-recipes/trtllm/deepseek-v4"
    "/agentx-gb300-20260811/dynamo-disagg-gb300-1p4d-dep4-tep8-c4-b1-mtp.yaml"
)
NO_CONC = (
    DATA
    / "inferencex-recipes-schema2/sglang/qwen3.5/gb200-fp4/agentic"
    / ("agg-gb200-tp2ep2-mtp-hicache.yaml")
)


def reported(built: object, key: str) -> str:
    return next(r.how for r in built.reported if r.key == key)  # type: ignore[attr-defined]


def test_a_sa_bench_recipe_runs_srt_slurms_client_at_its_concurrencies() -> None:
    built = spec_from_recipe(SA_BENCH)
    assert built.spec.client.command == [
        "sh",
        "-c",
        'exec python -m slurmgate.cli bench sa-bench "${OPENAI_BASE_URL%/v1}" --model dsr1 '
        "--tokenizer /model --isl 8192 --osl 1024 --concurrencies 48 --req-rate inf "
        # 1 prefill worker of 8 GPUs and 6 decode workers of 8: srt-slurm's file name's counts
        "--gpus 56 --disaggregated --prefill-gpus 8 --decode-gpus 48",
    ]
    assert reported(built, "benchmark").startswith("run as the client: slurmgate bench sa-bench")


def test_an_agentic_row_runs_aiperf_with_the_recipes_command_and_settings() -> None:
    built = spec_from_recipe(AGENTX)
    (script,) = built.spec.client.command[2:]
    assert script.startswith('exec python -m slurmgate.cli bench aiperf "${OPENAI_BASE_URL%/v1}" ')
    for part in (
        "--model DeepSeek-V4-Pro",  # SERVED_MODEL_NAME
        "--concurrencies 4 --duration 3600 --model-prefix dsv4",
        "--env WEKA_LOADER_OVERRIDE=semianalysis_cc_traces_weka_062126",
        "--env AIPERF_HTTP_X_DYNAMO_SESSION_ID_FROM_CORRELATION_ID=true",
        "--recipe-command 'bash /infmax-workspace/benchmarks/multi_node/agentic_srt.sh'",
    ):
        assert part in script, part
    assert "KEY" not in script  # a recipe's OPENAI_API_KEY never reaches argv
    assert "agentic_srt.sh" in reported(built, "benchmark")


def test_an_agentic_row_without_its_concurrencies_gets_the_smoke_load_and_says_why() -> None:
    built = spec_from_recipe(NO_CONC)
    assert "slurmgate.cli loadgen" in built.spec.client.command[-1]
    how = reported(built, "benchmark")
    assert how.startswith("the agentic replay's concurrencies (CONC_LIST or CONC) come from")
    assert how.endswith("the client sends a short slurmgate loadgen --chat smoke load")


def test_the_rows_concurrencies_run_an_agentic_recipe_that_has_none() -> None:
    """InferenceX hands its agentic script the matrix row's CONC_LIST: --conc does the same."""
    built = spec_from_recipe(NO_CONC, site=Site(conc="4x8"))
    (script,) = built.spec.client.command[2:]
    assert "bench aiperf" in script and "--concurrencies 4x8" in script, script
    for bad in ("0x4", "four", "4x" + "x".join(["1"] * 40)):
        with pytest.raises(InputError, match=r"^--conc: .* is not a list of positive"):
            spec_from_recipe(NO_CONC, site=Site(conc=bad))


def test_the_recipes_own_command_runs_as_written_where_its_workspace_is_mounted(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "infmax-workspace"
    workspace.mkdir()
    script = workspace / "agentic_srt.sh"
    # InferenceX's script reads CONC_LIST and RESULT_DIR; this one records what it was given
    script.write_text('echo "$CONC_LIST|$RESULT_DIR|$WEKA_LOADER_OVERRIDE" > "$RESULT_DIR/seen"\n')
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "slurmgate.cli", "bench", "aiperf", "http://127.0.0.1:9"]
    argv += ["--model", "m", "--tokenizer", "/model", "--concurrencies", "4x8"]
    argv += ["--env", "WEKA_LOADER_OVERRIDE=x", "--recipe-command", f"bash {script}"]
    done = subprocess.run(
        [*argv, "--results-dir", str(results)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (results / "seen").read_text() == f"4 8|{results}|x\n"
    assert "running the recipe's command as written" in done.stdout
