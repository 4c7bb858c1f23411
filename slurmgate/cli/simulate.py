"""`slurmgate simulate`: replay a job trace through the planner and print its metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from slurmgate.admission.policies import SIMULATED_POLICY_NAMES
from slurmgate.cli.common import fail
from slurmgate.simulator.engine import (
    ESTIMATES,
    SimulationError,
    parse_pools,
    replay_knobs,
    replay_settings,
    simulate,
)
from slurmgate.simulator.traces import TraceError, read_trace

app = typer.Typer()


@app.command(
    "simulate",
    epilog=(
        "Example: slurmgate simulate slurmgate/data/traces/KTH-SP2-1996-2.1-cln.swf.gz "
        "--pools 100 --json (no policy flags: the controller's defaults)"
    ),
)
def simulate_command(
    trace: Annotated[Path, typer.Argument(help="An SWF log (.swf or .swf.gz) or the job-mix CSV.")],
    pools: Annotated[
        str | None,
        typer.Option(
            help="Pool sizes: 100 or 32,32,16 (any job on any pool), or name=size,... for the "
            "job mix (default: the trace's own pools)."
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            help="fcfs | greedy | easy | conservative (default: the controller's, "
            "SLURMGATE_POLICY's default)."
        ),
    ] = None,
    arrival_scale: Annotated[
        float, typer.Option(help="Multiply inter-arrival times (0.8 = 25% more load).")
    ] = 1.0,
    size_scale: Annotated[
        float, typer.Option(help="Divide job sizes, rounding up (32 for LANL on 32 nodes).")
    ] = 1.0,
    wide_frac: Annotated[
        float,
        typer.Option(
            help="Wide jobs in the report: more nodes than this fraction of the largest pool."
        ),
    ] = 0.25,
    wide_fraction: Annotated[
        str | None,
        typer.Option(
            help="The planner's wide-job rules (wide_fraction): only a job needing more than "
            "this part of its largest pool waits --reserve-after, and a job starting beside its "
            "reservation is taken at its timeout; none turns them off (default: the "
            "controller's)."
        ),
    ] = None,
    estimates: Annotated[
        str | None,
        typer.Option(help="timeout | learned | perfect (default: the controller's)."),
    ] = None,
    reserve_after: Annotated[
        float | None,
        typer.Option(
            help="Hours a blocked job waits before it gets a reservation (default: the "
            "controller's reserve_after_s; 0 = classic EASY)."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N jobs.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write a Gantt chart of the busiest pool's busiest day.")
    ] = None,
) -> None:
    """Replay TRACE through the planner's policy and report waits, slowdown and utilization."""
    try:
        # a flag not given keeps the controller's default, from the one settings object
        given: dict[str, object] = {}
        if reserve_after is not None:
            given["reserve_after_s"] = reserve_after * 3600
        if wide_fraction is not None:
            given["wide_fraction"] = wide_fraction
        settings = replay_settings(given)
        policy = settings.policy if policy is None else policy
        estimates = settings.estimates if estimates is None else estimates
        if policy not in SIMULATED_POLICY_NAMES:
            choices = ", ".join(SIMULATED_POLICY_NAMES)
            raise SimulationError(f"--policy {policy!r} is not one of {choices}")
        if estimates not in ESTIMATES:
            raise SimulationError(f"--estimates {estimates!r} is not one of {', '.join(ESTIMATES)}")
        if not 0 < wide_frac <= 1:
            raise SimulationError(f"--wide-frac {wide_frac} must be in (0, 1]")
        loaded = read_trace(trace, size_scale=size_scale, arrival_scale=arrival_scale, limit=limit)
        pool_sizes, bound = parse_pools(pools, loaded)
        started = time.perf_counter()
        result = simulate(
            loaded, pool_sizes, policy, estimates=estimates, bound=bound, settings=settings
        )
        elapsed = time.perf_counter() - started
    except (TraceError, SimulationError) as exc:
        raise fail(str(exc)) from None
    metrics = result.metrics(wide_frac)
    metrics.update(
        trace=loaded.name,
        arrival_scale=arrival_scale,
        size_scale=size_scale,
        reserve_after_h=settings.reserve_after_s / 3600,
        settings=replay_knobs(settings, policy, estimates),
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
            raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(metrics, sort_keys=True))
        return
    for key in sorted(metrics):
        value = metrics[key]
        typer.echo(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}")
