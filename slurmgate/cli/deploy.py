"""`slurmgate deploy`: the packaged Prefect deployments through `prefect deploy`, from anywhere."""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated

import typer

from slurmgate.cli.common import fail

app = typer.Typer()


@app.command(
    "deploy",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Example: slurmgate deploy  (then: prefect worker start --pool slurmgate). "
    "Arguments after the options go to prefect deploy, e.g. slurmgate deploy --pool gpu-site",
)
def deploy(
    ctx: typer.Context,
    print_file: Annotated[
        bool,
        typer.Option("--print-file", help="Print the path of the packaged prefect.yaml and stop."),
    ] = False,
) -> None:
    """Create or update the reconcile, release-lease and allocation deployments.

    Runs `prefect --no-prompt deploy --all` on the prefect.yaml installed with slurmgate, in the
    current directory, with this environment's Python: the entrypoints are module paths, so no
    checkout is needed here or on the workers.
    """
    from slurmgate.cli import prefect_layer

    path = prefect_layer.prefect_yaml()
    if print_file:
        typer.echo(str(path))
        return
    argv = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"]
    argv += ["--prefect-file", str(path), *ctx.args]
    try:
        code = subprocess.call(argv)
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None
    if code != 0:
        raise fail(f"prefect deploy exited with {code} (its output is above)", code=1)
