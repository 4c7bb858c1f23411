"""`slurmgate demo`: admission on a GitHub emulator, then the runtime on Slurm, then a summary."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from slurmgate.cli.common import fail
from slurmgate.errors import ExternalError

app = typer.Typer()


class Mode(StrEnum):
    DEPLOYMENT = "deployment"
    DIRECT = "direct"


class Live(StrEnum):
    AUTO = "auto"
    YES = "yes"
    NO = "no"


@app.command(
    "demo", epilog="Example: slurmgate demo --mode direct --skip-runtime --live no  (make demo)"
)
def demo(
    mode: Annotated[
        Mode, typer.Option(help="deployment: a served reconcile per tick; direct: in process.")
    ] = Mode.DEPLOYMENT,
    load: Annotated[float, typer.Option(help="Queued nodes per pool runner.")] = 1.75,
    never_fits: Annotated[int, typer.Option(help="Too-wide jobs per pool.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the job draw.")] = 7,
    duration: Annotated[float, typer.Option(help="Mean job seconds.")] = 4.0,
    skip_runtime: Annotated[bool, typer.Option(help="Admission only.")] = False,
    skip_admission: Annotated[bool, typer.Option(help="Runtime only.")] = False,
    live: Annotated[Live, typer.Option(help="A live board (auto: on a terminal).")] = Live.AUTO,
    workdir: Annotated[
        Path | None, typer.Option(help="Logs, records and summary.json (default: a temp dir).")
    ] = None,
) -> None:
    """Run the demo on the embedded defaults; exits 1 when any check of it failed."""
    from slurmgate.cli import prefect_layer
    from slurmgate.testbed.demo import DemoOptions

    options = DemoOptions(
        mode=mode.value,
        load=load,
        never_fits=never_fits,
        seed=seed,
        duration_s=duration,
        skip_runtime=skip_runtime,
        skip_admission=skip_admission,
        live={Live.AUTO: None, Live.YES: True, Live.NO: False}[live],
        workdir=workdir,
    )
    try:
        code = prefect_layer.run_demo(options)
    except ExternalError as exc:  # the Prefect API it would use does not answer
        raise fail(str(exc), code=1) from None
    if code:
        raise typer.Exit(code=code)
