"""Typer sub-apps: `slurmgate cluster up|down` and `slurmgate allocation run SPEC|reap`."""

from __future__ import annotations

import importlib
import signal
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

cluster_app = typer.Typer(
    name="cluster",
    help="Start and stop the bundled local Slurm cluster (root, Debian).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
allocation_app = typer.Typer(
    name="allocation",
    help="Run an allocation spec through Prefect, or reap what a killed run left behind.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@cluster_app.command(
    "up", epilog="Example: slurmgate cluster up --mode netns  (then: export SLURM_CONF=...)"
)
def cluster_up(
    mode: Annotated[str, typer.Option(help="netns (one IP per node) or uts.")] = "netns",
) -> None:
    """Start the cluster (idempotent) and print the environment to use."""
    from slurmgate.cluster import ClusterError, up

    try:
        env = up(mode=mode)
    except ClusterError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(env.exports())


@cluster_app.command("down", epilog="Example: slurmgate cluster down")
def cluster_down() -> None:
    """Stop the cluster (safe when it is not running)."""
    from slurmgate.cluster import ClusterError, down

    try:
        down()
    except ClusterError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo("slurm-local cluster stopped")


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@allocation_app.command(
    "run", epilog="Example: slurmgate allocation run examples/specs/local-stub.yaml"
)
def allocation_run(
    spec: Annotated[Path, typer.Argument(help="The allocation spec (YAML).")],
    runs_dir: Annotated[
        Path | None, typer.Option(help="Run directories (logs, record.json).")
    ] = None,
) -> None:
    """Run the allocation flow; exits non-zero when the run (or its cleanup) fails."""
    from slurmgate.runtime.spec import AllocationSpec, SpecError

    try:
        parsed = AllocationSpec.from_yaml(spec)
    except SpecError as exc:
        typer.echo(f"error: invalid spec {spec}:\n{exc}", err=True)
        raise typer.Exit(code=2) from None
    # The Prefect layer lives outside the core; import it only for this command.
    flow: Any = importlib.import_module("flows.allocation").allocation
    # Prefect turns SIGTERM into its own exception during the run and re-delivers the signal
    # afterwards; exiting through SystemExit (not the default action) lets atexit stop the
    # ephemeral Prefect server instead of orphaning it.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        summary = flow(spec=parsed, runs_dir=str(runs_dir) if runs_dir else None)
    except Exception as exc:
        typer.echo(f"error: allocation run failed: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"run {summary['run_id']} succeeded on {','.join(summary['hosts'])}")


@allocation_app.command("reap", epilog="Example: slurmgate allocation reap")
def allocation_reap(
    runs_dir: Annotated[
        Path | None, typer.Option(help="Run directories to scan (default: the runs root).")
    ] = None,
) -> None:
    """Cancel the Slurm jobs and steps of runs whose controller was killed."""
    from slurmgate.runtime.controller import load_records, reap_leftovers
    from slurmgate.runtime.slurm import SlurmError

    try:
        actions = reap_leftovers(load_records(runs_dir))
    except SlurmError as exc:
        typer.echo(
            f"reap stopped, Slurm did not answer ({exc}); the run records are kept: "
            "check SLURM_CONF and that slurmctld is up, then run it again",
            err=True,
        )
        raise typer.Exit(code=1) from None
    for action in actions:
        typer.echo(action)
    typer.echo(f"{len(actions)} leftover(s) reaped")
