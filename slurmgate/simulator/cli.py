"""`slurmgate simulate`: replay a job trace through the planner and print its metrics."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from slurmgate.simulator.engine import (
    ESTIMATES,
    POLICY_NAMES,
    SimulationError,
    parse_pools,
    sim_settings,
    simulate,
)
from slurmgate.simulator.traces import TraceError, read_trace

app = typer.Typer(add_completion=False, help=__doc__)


@app.command("simulate")
def simulate_command(
    trace: Annotated[Path, typer.Argument(help="An SWF log (.swf or .swf.gz) or the job-mix CSV.")],
    pools: Annotated[
        str | None,
        typer.Option(
            help="Pool sizes: 100 or 32,32,16 (any job on any pool), or name=size,... for the "
            "job mix (default: the trace's own pools)."
        ),
    ] = None,
    policy: Annotated[str, typer.Option(help="fcfs | greedy | easy | conservative")] = "easy",
    arrival_scale: Annotated[
        float, typer.Option(help="Multiply inter-arrival times (0.8 = 25% more load).")
    ] = 1.0,
    size_scale: Annotated[
        float, typer.Option(help="Divide job sizes, rounding up (32 for LANL on 32 nodes).")
    ] = 1.0,
    wide_frac: Annotated[
        float, typer.Option(help="Wide jobs: more nodes than this fraction of the largest pool.")
    ] = 0.25,
    estimates: Annotated[str, typer.Option(help="timeout | learned | perfect")] = "timeout",
    reserve_after: Annotated[
        float, typer.Option(help="Hours a blocked job waits before it gets a reservation.")
    ] = 0.0,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N jobs.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write a Gantt chart of the busiest pool's busiest day.")
    ] = None,
) -> None:
    """Replay TRACE through the planner's policy and report waits, slowdown and utilization."""
    try:
        if policy not in POLICY_NAMES:
            raise SimulationError(f"--policy {policy!r} is not one of {', '.join(POLICY_NAMES)}")
        if estimates not in ESTIMATES:
            raise SimulationError(f"--estimates {estimates!r} is not one of {', '.join(ESTIMATES)}")
        if not 0 < wide_frac <= 1:
            raise SimulationError(f"--wide-frac {wide_frac} must be in (0, 1]")
        if reserve_after < 0:
            raise SimulationError(f"--reserve-after {reserve_after} must be >= 0 hours")
        loaded = read_trace(trace, size_scale=size_scale, arrival_scale=arrival_scale, limit=limit)
        pool_sizes, bound = parse_pools(pools, loaded)
        started = time.perf_counter()
        result = simulate(
            loaded,
            pool_sizes,
            policy,
            estimates=estimates,
            bound=bound,
            settings=sim_settings(reserve_after_s=reserve_after * 3600),
        )
        elapsed = time.perf_counter() - started
    except (TraceError, SimulationError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    metrics = result.metrics(wide_frac)
    metrics.update(
        trace=loaded.name,
        arrival_scale=arrival_scale,
        size_scale=size_scale,
        reserve_after_h=reserve_after,
        dropped=loaded.dropped,
        plans=result.plans,
        seconds=round(elapsed, 3),
    )
    if plot is not None:
        from slurmgate.simulator.plots import PlotError, gantt

        try:
            metrics["plot"] = str(
                gantt(result.runs, plot, wide_above=wide_frac * max(pool_sizes.values()))
            )
        except PlotError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(metrics, sort_keys=True))
        return
    for key in sorted(metrics):
        value = metrics[key]
        typer.echo(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}")


def simulate_main(argv: list[str] | None = None) -> int:
    """Run `simulate` with `argv` (the flags after the word `simulate`); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = app(args=args, prog_name="slurmgate simulate", standalone_mode=False)
        if isinstance(code, int):
            return code
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except SystemExit as exc:  # click usage errors
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    except Exception as exc:  # click.UsageError and friends in non-standalone mode
        if hasattr(exc, "show"):
            exc.show()
            return 2
        raise
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(simulate_main())
