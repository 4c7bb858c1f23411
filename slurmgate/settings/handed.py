"""The environment read outside the models: what a step was handed, and what a child inherits.

The standard library only: the node worker imports it on every node. Three kinds of read live
here, and nowhere else outside the settings models and `slurmgate.slurm.jobenv`:

- what the runtime hands the processes it starts (a node worker, a lane, an endpoint, the
  client workload), read on their side: the GPUs a lane may use, the endpoints and their
  token, where the client's load reports go, a stub lane's knobs, the demo's start stamp;
- the environment a process passes on to a child it starts (a step, a script, a server),
  which the child inherits whole or allow-listed;
- a variable whose name the configuration gives, not slurmgate (a spec's secret reference,
  a Slurm cluster's token variable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The GPUs a node worker may use (Slurm's GRES, or the site), and the ones it gives a lane."""
ENDPOINT_TOKEN = "SLURMGATE_ENDPOINT_TOKEN"
"""The bearer token of the logical endpoints, handed to the endpoint and the client, never argv."""
ENDPOINTS = "SLURMGATE_ENDPOINTS"
"""The client's endpoints, NAME=URL by comma."""
CLIENT_REPORTS_DIR = "SLURMGATE_RUN_REPORTS_DIR"
"""Where the client workload writes its load reports for the run to publish."""
RESULTS_DIR = "SLURMGATE_RESULTS_DIR"
"""Where a lane or the client writes the files the run collects as its results (one folder per
node); `slurmgate bench` writes the benchmark tools' raw results there (else the reports dir)."""
STAND_IN_MODEL_DIR = "SLURMGATE_STAND_IN_MODEL_DIR"
"""The model directory the first deployment's stand-in loads: a benchmark client's tokenizer."""
LOGS_DIR = "SLURMGATE_LOGS_DIR"
"""Where a lane may write log files of its own beside the log the node worker keeps of it."""
NODE_OUTPUTS_ROOT = "SLURMGATE_NODE_OUTPUTS_ROOT"
"""The node-local directory under which each run's logs and results wait to be collected."""
SERVER_METRICS_URLS = "AIPERF_SERVER_METRICS_URLS"
"""The Prometheus endpoints of the client's deployment's serving processes, by comma, under the
name InferenceX's agentic replay reads (its AIPerf scrapes them beside the endpoint's own)."""
STUB_KNOB_PREFIX = "SLURMGATE_STUB_"
"""A stub lane's knobs, from the spec's env of the lane."""
DEMO_STARTED_AT = "SLURMGATE_DEMO_STARTED_AT"
"""When scripts/demo.sh started the demo, in epoch seconds."""

PROCESS_ENVIRONMENT: Mapping[str, str] = os.environ
"""This process's live environment, for a reader that takes a mapping (tests pass their own)."""


def handed(name: str) -> str | None:
    """The value the process that started this one handed it as `name`, if any."""
    return os.environ.get(name)


def hand_down(name: str, value: str) -> None:
    """Set `name` for this process's children, unless the process was handed it already."""
    os.environ.setdefault(name, value)


def inherited() -> dict[str, str]:
    """A copy of this process's environment, for a child to inherit (before its own values)."""
    return dict(os.environ)


def named(name: str) -> str | None:
    """The variable a configuration names (a secret reference, a token variable), if set."""
    return os.environ.get(name)
