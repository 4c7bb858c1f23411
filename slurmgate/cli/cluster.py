"""`slurmgate cluster up|down`: the bundled local Slurm cluster (root, Debian)."""

from __future__ import annotations

from typing import Annotated

import typer

from slurmgate.cli.common import fail

app = typer.Typer(
    help="Start and stop the bundled local Slurm cluster (root, Debian).", no_args_is_help=True
)


@app.command(
    "up", epilog="Example: slurmgate cluster up --mode netns  (then: export SLURM_CONF=...)"
)
def cluster_up(
    mode: Annotated[str, typer.Option(help="netns (one IP per node) or uts.")] = "netns",
) -> None:
    """Start the cluster (idempotent) and print the environment to use."""
    from slurmgate.testbed.cluster import ClusterError, up

    try:
        env = up(mode=mode)
    except ClusterError as exc:
        raise fail(str(exc), code=1) from None
    typer.echo(env.exports())


@app.command("down", epilog="Example: slurmgate cluster down")
def cluster_down() -> None:
    """Stop the cluster (safe when it is not running)."""
    from slurmgate.testbed.cluster import ClusterError, down

    try:
        down()
    except ClusterError as exc:
        raise fail(str(exc), code=1) from None
    typer.echo("slurm-local cluster stopped")
