"""`slurmgate cluster up|down`: the bundled local Slurm cluster (root, Debian)."""

from __future__ import annotations

from typing import Annotated

import typer

from slurmgate.cli.common import fail

app = typer.Typer(
    help="Start and stop the bundled local Slurm cluster (root, Debian).", no_args_is_help=True
)


@app.command(
    "up",
    epilog="Example: slurmgate cluster up --mode netns  (slurmgate finds it from then on; "
    "the printed export is for your own sinfo and srun)",
)
def cluster_up(
    mode: Annotated[str, typer.Option(help="netns (one IP per node) or uts.")] = "netns",
) -> None:
    """Start the cluster (idempotent), remember it for slurmgate, and print its SLURM_CONF."""
    from slurmgate.progress import progress
    from slurmgate.testbed.cluster import ClusterError, up

    try:
        # The first start installs Debian's Slurm packages: a minute or more of silence else.
        with progress("slurm-local: bringing up the bundled Slurm cluster", done="up"):
            env = up(mode=mode, record=True)
    except ClusterError as exc:
        raise fail(str(exc), code=1) from None
    typer.echo(env.exports())


@app.command("down", epilog="Example: slurmgate cluster down")
def cluster_down(
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Stop the cluster even if `slurmgate cluster up` did not start it."
        ),
    ] = False,
) -> None:
    """Stop the cluster `slurmgate cluster up` started; others are left running unless --force."""
    from slurmgate.testbed.cluster import ClusterError, down

    try:
        result = down(only_if_started=not force, forget=True)
    except ClusterError as exc:
        raise fail(str(exc), code=1) from None
    if result.stopped:
        typer.echo("slurm-local cluster stopped")
    else:
        typer.echo(
            f"slurm-local cluster in {result.directory} left running: {result.reason} "
            "(`slurmgate cluster down --force` stops it)"
        )
