"""Trace-replay simulator: real job logs through the planner's own policies, in simulated time."""

from slurmgate.simulator.engine import Result, SimulationError, simulate, simulate_via_plan
from slurmgate.simulator.traces import Trace, TraceError, TraceJob, read_trace

__all__ = [
    "Result",
    "SimulationError",
    "Trace",
    "TraceError",
    "TraceJob",
    "read_trace",
    "simulate",
    "simulate_via_plan",
]
