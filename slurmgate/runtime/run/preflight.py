"""Preflight: the client host, then every node, checked before anything heavy starts."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.run.workers import client_worker_spec, start_workers, worker_spec
from slurmgate.runtime.steps import protocol

PREFLIGHT_TIMEOUT_S = 120.0

# The seed gives its client 32 CPUs; an allocation that holds fewer on the client node gets
# them all (a step cannot ask for more than the job holds there).
SEED_CLIENT_CPUS = 32

# What slurmstepd says when a task's program cannot be executed, and Python without slurmgate.
_EXEC_FAILED = re.compile(
    r"slurmstepd(?:-(?P<node>[^:\s]+))?: error: execve\(\): (?P<path>[^:]+): (?P<reason>[^\n]*)"
)
_NO_SLURMGATE = re.compile(r"No module named '?slurmgate")


@dataclass(frozen=True)
class NodeReport:
    """What a node's preflight task reported: the node it ran on, its CPUs and GPUs."""

    host: str
    cpus: int
    gpus: int


def preflight_reports(log: str, planned: list[str], step: str) -> dict[str, NodeReport]:
    """Every planned node reported from itself, once: else RunFailed naming the node."""
    reports = [
        NodeReport(host=m.host, cpus=m.cpus, gpus=m.gpus)
        for m in protocol.messages(log, protocol.PreflightPassed)
    ]
    stray = [r.host for r in reports if r.host not in planned]
    if stray:
        raise RunFailed(
            "preflight",
            f"{step}: a task ran on {stray[0]}, which the plan does not have "
            f"(planned: {', '.join(planned)}); the node's SLURMD_NODENAME must be its name in "
            "the allocation",
        )
    by_host = {r.host: r for r in reports}
    missing = [h for h in planned if h not in by_host]
    if missing or len(reports) != len(planned):
        raise RunFailed(
            "preflight",
            f"{step}: node {missing[0] if missing else planned[0]} did not report its preflight "
            f"({len(reports)} report(s) for {len(planned)} node(s))",
        )
    return by_host


def preflight(ctx: RunContext) -> None:
    """Client (zero GPU) first, then every node of every deployment; nothing heavy starts."""
    ctx.enter("preflight")
    assert ctx.layout and ctx.job_id
    t0 = time.monotonic()
    client = start_workers(
        ctx,
        "preflight-client",
        "preflight",
        client_worker_spec(ctx),
        [ctx.layout.client_host],
        gres="none",
        env=ctx.base_env(),
        required=False,
    )
    (report,) = _expect_ok(ctx, client, [ctx.layout.client_host]).values()
    if ctx.client_cpus is None:
        ctx.client_cpus = max(1, min(SEED_CLIENT_CPUS, report.cpus))
        ctx.log(
            f"decision: the client gets {ctx.client_cpus} CPU(s): the allocation holds "
            f"{report.cpus} on {report.host}, the default asks for up to {SEED_CLIENT_CPUS}"
        )
    steps = []
    for d in ctx.plan.deployments:
        steps.append(
            (
                d,
                start_workers(
                    ctx,
                    f"preflight-{d.name}",
                    "preflight",
                    worker_spec(ctx, d),
                    ctx.layout.nodelist(d),
                    gres=None,
                    env=ctx.base_env(ctx.credentials.deployment_env[d.index]),
                    required=False,
                ),
            )
        )
    for d, step in steps:
        _expect_ok(ctx, step, ctx.layout.nodelist(d))
    ctx.timings.mark("preflight_done", t0)
    ctx.log(f"preflight passed on {len(ctx.layout.hosts)} node(s)")


def _expect_ok(ctx: RunContext, step: Any, planned: list[str]) -> dict[str, NodeReport]:
    """The preflight step passed, and each planned node reported from itself."""
    rc = ctx.supervisor.wait(step, timeout=PREFLIGHT_TIMEOUT_S)
    tail = step.log_tail(4000 + 200 * len(planned))
    if rc == 0:
        return preflight_reports(tail, planned, step.name)
    problem = interpreter_problem(ctx, tail)
    if problem:
        raise RunFailed("preflight", problem)
    found = protocol.messages(tail, protocol.PreflightCheckFailed)
    if found:
        first = found[0]
        raise RunFailed("preflight", f"node {first.host}: check {first.check}: {first.detail}")
    raise RunFailed("preflight", f"{step.name} exited {rc}: {tail.strip()[-600:]}")


def interpreter_problem(ctx: RunContext, log: str) -> str | None:
    """The node-side interpreter could not run, or has no slurmgate: a message naming
    the spec's `python` field and the fix; None for any other failure."""
    exec_failed = _EXEC_FAILED.search(log)
    if exec_failed and exec_failed.group("path") == ctx.python:
        node = exec_failed.group("node") or "a node"
        cause = f"cannot run on {node} ({exec_failed.group('reason').strip()})"
    elif _NO_SLURMGATE.search(log):
        cause = "has no slurmgate package on the nodes"
    else:
        return None
    if ctx.spec.python:
        return (
            f"python: {ctx.python} {cause} — fix: set the spec's `python` to an "
            "interpreter with slurmgate installed at that path on every node"
        )
    return (
        f"python: the controller's interpreter {ctx.python} {cause} — fix: install the "
        "same environment at the same path on the compute nodes, or set the spec's "
        "`python` to one that is there"
    )
