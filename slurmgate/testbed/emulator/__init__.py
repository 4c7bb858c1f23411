"""A GitHub API emulator: a real HTTP server for runners, labels, runs and jobs, with dispatch."""

from __future__ import annotations

from slurmgate.testbed.emulator.app import create_app, sign
from slurmgate.testbed.emulator.server import run_emulator
from slurmgate.testbed.emulator.state import (
    EmulatorInputError,
    EmulatorState,
    build_state,
    fleet_from_job_mix,
    parse_pool,
)

__all__ = [
    "EmulatorInputError",
    "EmulatorState",
    "build_state",
    "create_app",
    "fleet_from_job_mix",
    "parse_pool",
    "run_emulator",
    "sign",
]
