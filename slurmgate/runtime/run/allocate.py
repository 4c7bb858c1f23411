"""Allocate and resolve: attach to or salloc the job, then bind the layout to its hosts."""

from __future__ import annotations

import time
from typing import Any

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.ledger import heartbeat
from slurmgate.runtime.ledger.comment import ProcessIdentity, job_comment
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.slurm import commands as slurm


def allocate(ctx: RunContext) -> str:
    """Attach to SLURM_JOB_ID, or salloc one that this run owns and always cancels."""
    ctx.enter("allocate")
    t0 = time.monotonic()
    attached = slurm.current_job_id()
    if attached:
        ctx.job_id = attached
        ctx.log(f"decision: attach to allocation {attached} (SLURM_JOB_ID is set)")
    else:
        site = ctx.spec.slurm
        options = "".join(
            f", {name} {value}"
            for name, value in (
                ("partition", site.partition),
                ("account", site.account),
                ("qos", site.qos),
                ("reservation", site.reservation),
                ("constraint", site.constraint),
            )
            if value
        )
        if ctx.excluded_nodes:
            options += f", excluding {','.join(ctx.excluded_nodes)}"
        try:
            interval_s = heartbeat.interval_from_env()
        except ValueError as exc:
            raise RunFailed("allocate", str(exc)) from None
        ctx.log(
            f"decision: no SLURM_JOB_ID, salloc {ctx.plan.total_nodes} node(s) "
            f"with gpu:{ctx.spec.gpus_per_node}{options}"
        )
        ctx.owned_allocation = True  # before the call: a late grant is still ours to cancel
        ctx.save()
        # wall-clock instants, so a caller can line the grant up with events outside the
        # run (the CI job's dispatch to its runner, in the demo)
        ctx.timings.marks["salloc_asked_at_epoch"] = time.time()
        ctx.job_id = slurm.salloc_no_shell(
            **salloc_request(ctx), timeout=ctx.options.allocate_timeout_s
        )
        ctx.timings.marks["allocated_at_epoch"] = time.time()
        # a reaper on another host sees this run alive only through the comment's beat
        ctx.heartbeat = heartbeat.Heartbeat(
            ctx.job_id,
            ctx.run_id,
            ProcessIdentity.current(),
            interval_s=interval_s,
            warn=ctx.log,
        ).start()
    ctx.supervisor.job_id = ctx.job_id
    ctx.timings.mark("allocated", t0)
    ctx.save()
    return ctx.job_id


def salloc_request(ctx: RunContext) -> dict[str, Any]:
    """What `allocate` asks Slurm for when the run owns its allocation (`salloc_argv`)."""
    return {
        "nodes": ctx.plan.total_nodes,
        "job_name": ctx.run_id,
        "gpus_per_node": ctx.spec.gpus_per_node,
        "time_limit": ctx.spec.time_limit,
        "partition": ctx.spec.slurm.partition,
        "account": ctx.spec.slurm.account,
        "qos": ctx.spec.slurm.qos,
        "reservation": ctx.spec.slurm.reservation,
        "constraint": ctx.spec.slurm.constraint,
        "exclude": list(ctx.excluded_nodes),
        # who controls the job, for a reaper that cannot read this run's record
        "comment": job_comment(ctx.run_id, ProcessIdentity.current(), int(time.time())),
    }


def resolve(ctx: RunContext) -> layout_mod.Layout:
    """Hosts in allocation order → a bound layout; the node count must match the plan."""
    ctx.enter("resolve")
    assert ctx.job_id
    info = slurm.show_job(ctx.job_id)
    if info is None or not info.nodelist:
        raise RunFailed("resolve", f"allocation {ctx.job_id} is not running")
    hosts = slurm.show_hostnames(info.nodelist)
    addresses = slurm.node_addresses(hosts)
    try:
        ctx.layout = layout_mod.bind(ctx.plan, hosts, addresses)
    except layout_mod.LayoutError as exc:
        raise RunFailed("resolve", str(exc)) from None
    for row in layout_mod.describe(ctx.layout):
        ctx.log(
            "decision: lane {deployment} replica {replica} rank {rank} on {node} "
            "gpus {gpus} port {port} rendezvous {rendezvous} delay {delay_s}s".format(**row)
        )
    ctx.log(f"decision: client and endpoints on {ctx.layout.client_host}")
    ctx.save()
    return ctx.layout
