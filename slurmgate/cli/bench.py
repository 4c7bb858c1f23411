"""`slurmgate bench`: run a recipe's own benchmark tool (sa-bench, AIPerf) against an endpoint."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from slurmgate.cli.common import fail
from slurmgate.errors import ExternalError, InputError
from slurmgate.runtime.benchmarks import aiperf, run, sabench
from slurmgate.settings.handed import (
    CLIENT_REPORTS_DIR,
    RESULTS_DIR,
    SERVER_METRICS_URLS,
    handed,
)

app = typer.Typer(
    no_args_is_help=True,
    help="Run a recipe's benchmark tool, per concurrency, its raw results in a folder.",
)
REPO = Path(__file__).resolve().parents[2]
SABENCH_PYTHON = REPO / ".venv-sabench" / "bin" / "python"
AIPERF_CLI = REPO / ".venv-aiperf" / "bin" / "aiperf"

Url = Annotated[str, typer.Argument(help="Base URL of the endpoint, e.g. http://HOST:PORT.")]
Model = Annotated[str, typer.Option(help="The served model name sent in each request.")]
Tokenizer = Annotated[str, typer.Option(help="The model's tokenizer: a directory or a hub id.")]
Results = Annotated[
    Path | None,
    typer.Option(
        help=f"Folder of the raw results (default ${RESULTS_DIR}, else ${CLIENT_REPORTS_DIR}).",
        show_default=False,
    ),
]


def _results(flag: Path | None) -> Path:
    found = flag or next(
        (Path(v) for n in (RESULTS_DIR, CLIENT_REPORTS_DIR) if (v := handed(n))), None
    )
    if found is None:
        raise InputError(f"--results-dir: not given and ${RESULTS_DIR} is not set; give a folder")
    return found


@app.command(
    "sa-bench",
    epilog="Example: slurmgate bench sa-bench http://127.0.0.1:8000 --model m --tokenizer "
    "/models/m --isl 1024 --osl 1024 --concurrencies 4x8x16 --results-dir out",
)
def sa_bench(
    url: Url,
    model: Model,
    tokenizer: Tokenizer,
    isl: Annotated[int, typer.Option(help="Input tokens of each random prompt.")],
    osl: Annotated[int, typer.Option(help="Output tokens of each request (--ignore-eos).")],
    concurrencies: Annotated[str, typer.Option(help="Concurrencies, srt-slurm's 4x8x16.")],
    req_rate: Annotated[str, typer.Option(help="Requests per second, or inf.")] = "inf",
    random_range_ratio: Annotated[float, typer.Option(help="Prompt length spread.")] = 0.8,
    num_prompts_mult: Annotated[int, typer.Option(help="Prompts = concurrency × this.")] = 10,
    num_warmup_mult: Annotated[int, typer.Option(help="Warmup = concurrency × this.")] = 2,
    chat_template: Annotated[
        bool, typer.Option(help="Render prompts with the tokenizer's chat template.")
    ] = True,
    custom_tokenizer: Annotated[
        str | None, typer.Option(help="sa-bench's module.Class tokenizer.", show_default=False)
    ] = None,
    gpus: Annotated[int, typer.Option(help="Total GPUs, for the result file's name.")] = 0,
    prefill_gpus: Annotated[int, typer.Option(help="Disaggregated: prefill GPUs.")] = 0,
    decode_gpus: Annotated[int, typer.Option(help="Disaggregated: decode GPUs.")] = 0,
    disaggregated: Annotated[bool, typer.Option(help="Name files with ctx/gen GPUs.")] = False,
    results_dir: Results = None,
    python: Annotated[
        Path, typer.Option(help="The Python with sa-bench's dependencies (.venv-sabench).")
    ] = SABENCH_PYTHON,
) -> None:
    """srt-slurm's sa-bench client as its bench.sh runs it: a warmup and a saved run per
    concurrency, each result JSON in sa-bench_isl_<isl>_osl_<osl>/ of the results folder."""
    try:
        b = sabench.SaBench(
            url=url,
            model=model,
            tokenizer=tokenizer,
            isl=isl,
            osl=osl,
            concurrencies=sabench.parse_concurrencies(concurrencies),
            req_rate=req_rate,
            random_range_ratio=random_range_ratio,
            num_prompts_mult=num_prompts_mult,
            num_warmup_mult=num_warmup_mult,
            use_chat_template=chat_template,
            custom_tokenizer=custom_tokenizer,
            total_gpus=gpus,
            prefill_gpus=prefill_gpus,
            decode_gpus=decode_gpus,
            disaggregated=disaggregated,
        )
        saved = run.run_sa_bench(b, str(python), _results(results_dir))
    except InputError as exc:
        raise fail(str(exc)) from None
    except ExternalError as exc:
        raise fail(str(exc), code=1) from None
    for path in saved:
        typer.echo(path)


def _concurrencies(text: str) -> tuple[int, ...]:
    return sabench.parse_concurrencies(text.replace(",", "x").replace(" ", "x"))


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InputError(f"--env: {pair!r} is not NAME=VALUE; write it as NAME=VALUE")
        env[name] = value
    return env


def _recipe_script(command: str) -> Path | None:
    """The script a recipe's command runs (`bash /ws/x.sh` names /ws/x.sh), if it names one."""
    return next((Path(w) for w in shlex.split(command) if w.endswith(".sh")), None)


@app.command(
    "aiperf",
    epilog="Example: slurmgate bench aiperf http://127.0.0.1:8000 --model m --tokenizer "
    "/models/m --concurrencies 8x16 --input-file traces/ --duration 60 --results-dir out",
)
def aiperf_replay(
    url: Url,
    model: Model,
    tokenizer: Tokenizer,
    concurrencies: Annotated[str, typer.Option(help="Concurrencies: 4x8, 4,8 or '4 8'.")],
    duration: Annotated[int, typer.Option(help="Seconds of profiling per concurrency.")] = 1800,
    public_dataset: Annotated[
        str | None,
        typer.Option(help="An AIPerf Weka loader (its corpus from the hub).", show_default=False),
    ] = None,
    input_file: Annotated[
        Path | None,
        typer.Option(help="A local Weka trace file or folder instead.", show_default=False),
    ] = None,
    stand_in_traces: Annotated[
        bool,
        typer.Option(
            help="Replay a small generated Weka corpus (--local's stand-ins), not the hub's."
        ),
    ] = False,
    model_prefix: Annotated[
        str | None,
        typer.Option(
            help="InferenceX's model prefix: picks the default corpus.", show_default=False
        ),
    ] = None,
    max_context_length: Annotated[
        int | None, typer.Option(help="Skip traces longer than this.", show_default=False)
    ] = None,
    env: Annotated[
        list[str] | None, typer.Option(help="NAME=VALUE for AIPerf, e.g. the recipe's env.")
    ] = None,
    recipe_command: Annotated[
        str | None,
        typer.Option(
            help="The recipe's own command: run as written when the script it names exists.",
            show_default=False,
        ),
    ] = None,
    results_dir: Results = None,
    cli: Annotated[Path, typer.Option(help="AIPerf's command (.venv-aiperf).")] = AIPERF_CLI,
) -> None:
    """AIPerf's agentic trace replay as InferenceX's agentic_srt.sh runs it: one `aiperf profile`
    per concurrency, its artifacts in conc_<c>/aiperf_artifacts/ of the results folder."""
    try:
        extra = _env_pairs(env or [])
        results = _results(results_dir)
        levels = _concurrencies(concurrencies)
        if stand_in_traces:
            if public_dataset or input_file:
                raise InputError(
                    "--stand-in-traces: it replaces --public-dataset and --input-file; give one"
                )
            input_file = aiperf.write_stand_in_traces(results / "stand-in-traces", model)
            recipe_command = None  # the recipe's script replays the hub's corpus
        script = _recipe_script(recipe_command) if recipe_command else None
        if recipe_command and script is not None and script.exists():
            handed_env = {"CONC_LIST": " ".join(map(str, levels)), "RESULT_DIR": str(results)}
            typer.echo(f"[bench] {script} exists: running the recipe's command as written")
            log = results / "recipe_command.log"
            argv = tuple(shlex.split(recipe_command))
            run.run_tool(
                run.ToolRun("the recipe's command", argv, log),
                run.tool_env({**extra, **handed_env}),
            )
            return
        if recipe_command:
            typer.echo(f"[bench] {script} is not here: running AIPerf as that script would")
        loader = public_dataset
        if loader is None and input_file is None:
            loader = extra.get("WEKA_LOADER_OVERRIDE") or aiperf.default_loader(model_prefix)
        replay = aiperf.AgenticReplay(
            url=url,
            model=model,
            tokenizer=tokenizer,
            concurrencies=levels,
            duration=duration,
            loader=loader,
            input_file=input_file,
            max_context_length=max_context_length,
            # the recipe's own list, else the one the run hands its client
            server_metrics_urls=aiperf.server_metrics_urls(
                {SERVER_METRICS_URLS: handed(SERVER_METRICS_URLS) or "", **extra}
            ),
        )
        exports = run.run_aiperf(replay, str(cli), results, extra)
    except InputError as exc:
        raise fail(str(exc)) from None
    except ExternalError as exc:
        raise fail(str(exc), code=1) from None
    for path in exports:
        typer.echo(path)
