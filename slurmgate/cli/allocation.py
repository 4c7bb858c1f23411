"""`slurmgate allocation run|reap`: run a spec through Prefect, or reap what a killed run left."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from slurmgate.cli.common import fail
from slurmgate.cli.spec import (
    DynamoPythonOpt,
    LocalBenchOpt,
    LocalOpt,
    VllmCpuOpt,
    VllmPythonOpt,
)

app = typer.Typer(
    help="Run an allocation spec through Prefect, or reap what a killed run left behind.",
    no_args_is_help=True,
)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@app.command(
    "run",
    epilog="Example: slurmgate allocation run examples/specs/local-stub.yaml  (or --recipe "
    "RECIPE.yaml: an srt-slurm recipe, as `slurmgate spec from-recipe` builds its spec; "
    "--recipe RECIPE.yaml --local: on the bundled cluster with CPU stand-ins; add --vllm-cpu "
    "for a plain vLLM recipe on one real vLLM-CPU worker)",
)
def allocation_run(
    spec: Annotated[
        Path | None, typer.Argument(help="The allocation spec (YAML).", show_default=False)
    ] = None,
    runs_dir: Annotated[
        Path | None, typer.Option(help="Run directories (logs, record.json).")
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(help="Run an srt-slurm recipe (schema 1 or 2) instead of a spec."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="With --recipe: the model path the workers load.")
    ] = None,
    local: LocalOpt = False,
    dynamo_python: DynamoPythonOpt = None,
    vllm_cpu: VllmCpuOpt = False,
    vllm_python: VllmPythonOpt = None,
    bench: LocalBenchOpt = False,
    outputs_bucket: Annotated[
        str | None,
        typer.Option(
            help="A prefect-aws S3Bucket block: upload the run's collected logs and results "
            "there too (a failed upload keeps the local copy)."
        ),
    ] = None,
) -> None:
    """Run the allocation flow; exits non-zero when the run (or its cleanup) fails."""
    from slurmgate.cli import prefect_layer
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.runtime.spec.errors import SpecError
    from slurmgate.slurm import commands as slurm

    if (spec is None) == (recipe is None):
        raise fail("give a spec, or --recipe RECIPE.yaml (not both)")
    if local and recipe is None:
        raise fail("--local maps a recipe: give --recipe RECIPE.yaml")
    if vllm_cpu and recipe is None:
        raise fail("--vllm-cpu maps a plain vLLM recipe: give --recipe RECIPE.yaml --local")
    if recipe is not None:
        from slurmgate.cli.spec import load_recipe_spec

        built = load_recipe_spec(
            recipe,
            model,
            local=local,
            dynamo_python=dynamo_python,
            vllm_cpu=vllm_cpu,
            vllm_python=vllm_python,
            bench=bench,
        )
        parsed = built.spec
    else:
        assert spec is not None
        try:
            parsed = AllocationSpec.from_yaml(spec)
        except SpecError as exc:
            typer.echo(f"error: invalid spec {spec}:\n{exc}", err=True)
            raise typer.Exit(code=2) from None
    # Milliseconds now, instead of a Prefect traceback after the temporary server's ~20 s start.
    try:
        slurm.check_configured()
    except slurm.SlurmError as exc:
        raise fail(str(exc), code=1) from None
    # Prefect turns SIGTERM into its own exception during the run and re-delivers the signal
    # afterwards; exiting through SystemExit (not the default action) lets atexit stop the
    # ephemeral Prefect server instead of orphaning it.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        summary = prefect_layer.run_allocation(
            parsed, str(runs_dir) if runs_dir else None, outputs_bucket
        )
    except Exception as exc:
        raise fail(f"allocation run failed: {exc}", code=1) from None
    run_dir = Path(summary["record"]).parent
    for name, words in summary.get("hooks", {}).items():
        failed = name in summary.get("hooks_failed", [])
        # A failed epilog does not fail the run, so this line is where the person sees it.
        typer.echo(
            f"{'warning: ' if failed else ''}hook {name} {words} (hook-{name}.log)", err=failed
        )
    if summary.get("retry_of"):
        excluded = ",".join(summary.get("excluded_nodes", []))
        typer.echo(
            f"node failure: run {summary['retry_of']} failed on node {excluded}; "
            f"retried once without it (its record.json names the reason)"
        )
    if summary.get("outputs"):
        upload = summary.get("outputs_upload")
        typer.echo(
            f"every node's logs and results: {summary['outputs']}"
            + (f" (uploaded to {upload})" if upload and upload.startswith("s3://") else "")
        )
    # the last line says how the run ended
    typer.echo(
        f"run {summary['run_id']} succeeded on {','.join(summary['hosts'])}; "
        f"its step logs and record.json are in {run_dir}"
    )


@app.command("reap", epilog="Example: slurmgate allocation reap")
def allocation_reap(
    runs_dir: Annotated[
        Path | None, typer.Option(help="Run directories to scan (default: the runs root).")
    ] = None,
    all_users: Annotated[
        bool,
        typer.Option(
            "--all-users",
            help="Also cancel the allocations of other users' runs whose controller on this "
            "host died (found with squeue; needs root or a Slurm operator).",
        ),
    ] = False,
) -> None:
    """Cancel the Slurm jobs and steps of runs whose controller was killed."""
    from slurmgate.runtime.ledger.reaper import reap_stale_runs
    from slurmgate.runtime.ledger.records import load_records
    from slurmgate.slurm.commands import NO_CONFIGURATION, UNREADABLE_ANSWER

    tally = reap_stale_runs(
        load_records(runs_dir),
        wait_out_backoff=False,
        info=typer.echo,
        # Other users' jobs Slurm refuses to cancel are a warning naming the fix; this user's
        # runs' deferrals end in the one error line below.
        warn=(lambda line: typer.echo(f"warning: {line}", err=True))
        if all_users
        else print_nothing,
        all_users=all_users,
    )
    if tally.slurm_error is not None and NO_CONFIGURATION in tally.slurm_error:
        raise fail(
            f"reap stopped: {NO_CONFIGURATION}; the run records are kept for the next reap",
            code=1,
        )
    if tally.slurm_error is not None and UNREADABLE_ANSWER in tally.slurm_error:
        raise fail(
            f"reap stopped: {tally.slurm_error}; the run records are kept. slurmgate reads "
            "squeue's JSON as Slurm 22.05 and the data parser plugins of later releases print "
            "it: report this with `squeue --version`",
            code=1,
        )
    if tally.slurm_error is not None:
        raise fail(
            f"reap stopped, Slurm did not answer ({tally.slurm_error}); the run records are "
            "kept: check SLURM_CONF and that slurmctld is up, then run it again",
            code=1,
        )
    typer.echo(f"{tally.reaped} run(s) reaped, {len(tally.actions)} leftover(s) cancelled")


def print_nothing(line: str) -> None:
    return None
