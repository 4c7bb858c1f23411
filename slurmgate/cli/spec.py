"""`slurmgate spec check`, `from-recipe` and `from-row`: validate a spec, or build one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from slurmgate.cli.common import fail

if TYPE_CHECKING:
    from slurmgate.runtime.spec.from_recipe import RecipeSpec

app = typer.Typer(
    help="Allocation specs: check one, or build one from an srt-slurm recipe or a job-mix row.",
    no_args_is_help=True,
)

RecipeArg = Annotated[
    Path,
    typer.Argument(
        help="An srt-slurm recipe (schema 1 or 2, YAML); FILE.yaml:selector names one variant "
        "of a file with a base: section (base, override_NAME, zip_override_NAME[i])."
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(help="The model path the workers load on this site (default /model)."),
]
ContainerAliasOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--container",
        help="ALIAS=IMAGE, as srtslurm.yaml's containers: maps it (repeat for several): a "
        "recipe's model.container naming ALIAS runs IMAGE (a registry reference, a .sqsh file "
        "or an OCI bundle on the nodes).",
        show_default=False,
    ),
]
WorkspaceOpt = Annotated[
    str | None,
    typer.Option(
        help="srt-slurm's checkout on the nodes: its configs/ is mounted at /configs (the "
        "setup script's folder) and extra_mount's relative sources are under it.",
        show_default=False,
    ),
]
ConcOpt = Annotated[
    str | None,
    typer.Option(
        help="The job-mix row's concurrencies (InferenceX's CONC_LIST, e.g. 4x8): an agentic "
        "recipe without CONC of its own replays at these, as InferenceX hands them to it.",
        show_default=False,
    ),
]
ModelDirOpt = Annotated[
    str | None,
    typer.Option(
        help="The model's directory on the nodes, mounted in the container at --model.",
        show_default=False,
    ),
]
LocalOpt = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Map the recipe onto the bundled cluster (4 nodes of 8 GPUs): its roles scaled to "
        "fit, its frontend kept, CPU stand-ins for the engines; every change is reported.",
    ),
]
LocalBenchOpt = Annotated[
    bool,
    typer.Option(
        "--bench",
        help="With --local, for a recipe whose benchmark is sa-bench or InferenceX's agentic "
        "AIPerf replay: run that tool, scaled down, with the stand-in's tiny tokenizer (the "
        "replay over a small generated corpus), instead of three chats.",
    ),
]
DynamoPythonOpt = Annotated[
    str | None,
    typer.Option(
        help="With --local: the Dynamo venv's python, for the mocker and Dynamo's frontend "
        "(default: SLURMGATE_DYNAMO_PYTHON, else .venv-dynamo/bin/python).",
        show_default=False,
    ),
]
VllmCpuOpt = Annotated[
    bool,
    typer.Option(
        "--vllm-cpu",
        help="With --local, for a plain vLLM recipe (vllm serve, no router): one real vLLM-CPU "
        "worker (about 3 GB, a minute or more to start) on a tiny random-weight Llama, instead "
        "of Dynamo's mocker behind Dynamo's frontend; other recipes refuse it.",
    ),
]
VllmPythonOpt = Annotated[
    str | None,
    typer.Option(
        help="With --vllm-cpu: the vLLM-CPU venv's python (default: SLURMGATE_VLLM_PYTHON, "
        "else .venv-vllm/bin/python).",
        show_default=False,
    ),
]


def load_recipe_spec(
    recipe: Path,
    model: str | None,
    *,
    local: bool = False,
    dynamo_python: str | None = None,
    vllm_cpu: bool = False,
    vllm_python: str | None = None,
    containers: list[str] | None = None,
    workspace: str | None = None,
    model_dir: str | None = None,
    conc: str | None = None,
    bench: bool = False,
) -> RecipeSpec:
    """The recipe's spec (with `local`, mapped onto the bundled cluster; with `vllm_cpu`, a
    plain vLLM recipe on one vLLM-CPU worker), its reported keys said on stderr; or a one-line
    error (exit code 2) naming the key or the flag and the fix."""
    from slurmgate.errors import InputError
    from slurmgate.runtime.spec.from_recipe import Site, spec_from_recipe
    from slurmgate.runtime.spec.local_recipe import localize
    from slurmgate.settings.testbed import LocalClusterSettings

    try:
        if vllm_python is not None and not vllm_cpu:
            raise InputError("--vllm-python: names the python --vllm-cpu runs: add --vllm-cpu")
        if bench and not local:
            raise InputError("--bench: scales a recipe's benchmark for the stand-ins: add --local")
        if vllm_cpu and not local:
            raise InputError("--vllm-cpu: a stand-in on the bundled cluster: add --local")
        aliases = {}
        for pair in containers or []:
            alias, sep, image = pair.partition("=")
            if not sep or not alias or not image:
                raise InputError(
                    f"--container: {pair!r} is not ALIAS=IMAGE (dynamo-sglang=/x.sqsh)"
                )
            aliases[alias] = image
        site = Site(containers=aliases, workspace=workspace, model_dir=model_dir, conc=conc)
        built = spec_from_recipe(recipe, model=model, site=site)
        if local:
            settings = LocalClusterSettings()
            built = localize(
                built,
                dynamo_python=dynamo_python or settings.dynamo_python,
                vllm_python=(vllm_python or settings.vllm_python) if vllm_cpu else None,
                source=str(recipe),
                bench=bench,
            )
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    for r in built.reported:
        typer.echo(f"reported: {r.line()}", err=True)
    return built


@app.command(
    "from-recipe",
    epilog="Example: slurmgate spec from-recipe RECIPE.yaml --model /shared/models/dsr1 > "
    "spec.yaml  (the keys run differently are reported on stderr and in the YAML's header); "
    "with --local, the same shape on the bundled cluster with CPU stand-ins (--local "
    "--vllm-cpu: a plain vLLM recipe on one real vLLM-CPU worker)",
)
def from_recipe(
    recipe: RecipeArg,
    model: ModelOpt = None,
    local: LocalOpt = False,
    dynamo_python: DynamoPythonOpt = None,
    vllm_cpu: VllmCpuOpt = False,
    vllm_python: VllmPythonOpt = None,
    container: ContainerAliasOpt = None,
    workspace: WorkspaceOpt = None,
    model_dir: ModelDirOpt = None,
    conc: ConcOpt = None,
    bench: LocalBenchOpt = False,
) -> None:
    """Print the allocation spec of an srt-slurm recipe as YAML."""
    built = load_recipe_spec(
        recipe,
        model,
        local=local,
        dynamo_python=dynamo_python,
        vllm_cpu=vllm_cpu,
        vllm_python=vllm_python,
        containers=container,
        workspace=workspace,
        model_dir=model_dir,
        conc=conc,
        bench=bench,
    )
    typer.echo(built.yaml(str(recipe)), nl=False)
    if not built.spec.deployments:
        raise fail("the recipe has no deployment")


@app.command(
    "from-row",
    epilog="Example: slurmgate spec from-row dsr1-fp8-mi355x-sglang-disagg#0 --model "
    "/shared/models/DeepSeek-R1-0528 > spec.yaml  (an AMD row of "
    "slurmgate/data/inferencex-job-mix.csv, as InferenceX's scripts launch it; what runs "
    "differently is reported on stderr and in the YAML's header)",
)
def from_row(
    row_id: Annotated[
        str,
        typer.Argument(
            help="A row_id of the job mix from configs/amd-master.yaml, e.g. "
            "dsv4-fp4-mi355x-sglang-disagg#1."
        ),
    ],
    model: ModelOpt = None,
    ib_devices: Annotated[
        str,
        typer.Option(
            help="The nodes' RDMA devices, comma-separated: --disaggregation-ib-device and "
            "NCCL_IB_HCA (default: the MI355X runners' rdma0 … rdma7)."
        ),
    ] = "rdma0,rdma1,rdma2,rdma3,rdma4,rdma5,rdma6,rdma7",
) -> None:
    """Print the allocation spec of an InferenceX AMD multi-node row as YAML."""
    from slurmgate.errors import InputError
    from slurmgate.runtime.spec.from_row import spec_from_row

    try:
        built = spec_from_row(row_id, model=model, ib_devices=ib_devices)
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    for r in built.reported:
        typer.echo(f"reported: {r.line()}", err=True)
    typer.echo(built.yaml(), nl=False)


@app.command(
    "check",
    epilog="Example: slurmgate spec check /site/specs/nightly.yaml  (every problem, by field)",
)
def check(spec: Annotated[Path, typer.Argument(help="An allocation spec (YAML).")]) -> None:
    """Validate an allocation spec file and print every problem, or what it would run."""
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.runtime.spec.errors import SpecError

    try:
        parsed = AllocationSpec.from_yaml(spec)
    except SpecError as exc:
        raise fail(str(exc)) from None
    nodes = parsed.total_nodes
    typer.echo(f"ok: {parsed.name}, {len(parsed.deployments)} deployment(s), {nodes} node(s)")
