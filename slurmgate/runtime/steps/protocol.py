"""The lines a node worker writes for the controller to read: preflight results and lane exits."""

from __future__ import annotations

import re

# The line a node worker writes when one of its lanes exits: a failed step's error names the
# node and the lane from it, whatever else the log tail holds.
LANE_EXIT = "SLURMGATE-LANE-EXIT"
LANE_EXIT_LINE = re.compile(LANE_EXIT + r" host=(\S+) lane=(\S+) status=(-?\d+)")


def lane_exit_line(host: str, lane: str, status: int) -> str:
    return f"{LANE_EXIT} host={host} lane={lane} status={status}"


def lane_exit_cause(log: str) -> str:
    """`: lane L on node H exited with status N` for the first lane exit in a step's log."""
    found = LANE_EXIT_LINE.search(log)
    if found is None:
        return ""
    host, lane, status = found.groups()
    return f": lane {lane} on node {host} exited with status {status}"
