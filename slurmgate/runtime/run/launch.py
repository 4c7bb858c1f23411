"""Launch and readiness: one srun per deployment, then every lane head polled until ready."""

from __future__ import annotations

import time

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.engines import service_lanes
from slurmgate.runtime.run import discovery
from slurmgate.runtime.run.endpoints import ENDPOINT_STARTUP_S
from slurmgate.runtime.run.probes import ProbeOpener
from slurmgate.runtime.run.services import start_services
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.run.supervisor import StepFailed
from slurmgate.runtime.run.workers import (
    mpi_world_argv,
    mpi_world_spec,
    start_workers,
    worker_spec,
)
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.probe_step import ProbeStepFailed


def launch(ctx: RunContext, probes: ProbeOpener) -> None:
    """The services the workers register with (Dynamo's etcd and NATS), then one
    coordinated srun per deployment, one node worker per node, fail-fast."""
    ctx.enter("launch")
    assert ctx.layout and ctx.job_id
    for d in ctx.plan.deployments:
        start_services(ctx, probes, d, frontend=False, phase="launch")
    ctx.launched_at = time.monotonic()
    for d in ctx.plan.deployments:
        nodelist = ctx.layout.nodelist(d)
        ctx.log(f"decision: launch {d.name} as one srun on {','.join(nodelist)}")
        start_workers(
            ctx,
            f"serve-{d.name}",
            "serve",
            worker_spec(ctx, d),
            nodelist,
            gres=None,
            env=deployment_env(ctx, d),
            required=True,
            deployment=ctx.spec.deployments[d.index],
        )
        for world in d.mpi_worlds():
            start_mpi_world(ctx, d, world)
    ctx.supervisor.resolve_step_ids(timeout=3.0)
    ctx.save()


def deployment_env(ctx: RunContext, d: layout_mod.DeploymentPlan) -> dict[str, str]:
    """The environment of a deployment's steps: its services', discovery's and credentials'."""
    assert ctx.layout
    dspec = ctx.spec.deployments[d.index]
    return ctx.base_env(
        {
            **service_lanes.service_env(dspec, ctx.layout),
            **discovery.env(ctx, dspec),
            **ctx.credentials.deployment_env[d.index],
        }
    )


def start_mpi_world(
    ctx: RunContext, d: layout_mod.DeploymentPlan, world: layout_mod.MpiWorld
) -> None:
    """One worker over several nodes as one MPI world: its own step, required like the
    deployment's, its rank 0 probed as the worker's head."""
    assert ctx.layout
    name = f"serve-{d.name}-{world.name}"
    nodelist = [ctx.layout.host(n) for n in world.nodes]
    ctx.log(
        f"decision: launch {d.name}'s {world.head.role or 'replica'} worker "
        f"{world.head.replica} as one MPI world of {world.size} ranks "
        f"(srun --mpi=pmix, {world.ranks_per_node} per node) on {','.join(nodelist)}"
    )
    ctx.supervisor.start(
        name,
        mpi_world_argv(ctx, name, nodelist, world.ranks_per_node, ctx.spec.deployments[d.index]),
        step_name=ctx.step_name(name),
        stdin_data=mpi_world_spec(ctx, d, world).encode().encode(),
        env=deployment_env(ctx, d),
        required=True,
    )


def wait_ready(ctx: RunContext, probes: ProbeOpener) -> float:
    """Poll every lane head until ready; a dead step fails at once, a deadline fails late."""
    ctx.enter("readiness")
    assert ctx.layout
    targets: list[readiness.Target] = []
    for d in ctx.plan.deployments:
        dspec = ctx.spec.deployments[d.index]
        if not engines.profile(dspec.engine).lane_http:
            # Dynamo's workers answer no HTTP: their frontend lists them when it is ready
            continue
        models, lists_model = engines.profile(dspec.engine).models_probe(dspec.command)
        for lane, url in zip(d.heads, ctx.layout.head_urls(d), strict=True):
            targets.append(
                readiness.Target(
                    name=lane.process_id,
                    base_url=url,
                    path=dspec.readiness_path,
                    deadline=ctx.launched_at
                    + lane.delay_s
                    + dspec.startup_timeout_s
                    + (dspec.container.import_allowance_s if dspec.container else 0.0),
                    needed=dspec.ready_probes,
                    models=models,
                    lists_model=lists_model,
                )
            )
    probe_timeout = min(d.probe_timeout_s for d in ctx.spec.deployments)

    def progress(ready: int, total: int) -> None:
        ctx.log(f"readiness: {ready}/{total} lane heads ready")
        if ctx.on_progress:
            ctx.on_progress("lanes", ready, total)

    # The probe step lives through the endpoints' start too: bound it by both.
    last = max((t.deadline for t in targets), default=time.monotonic()) - time.monotonic()
    try:
        prober = probes.open_prober(last + ENDPOINT_STARTUP_S + 60.0)
        seconds = readiness.wait_ready(
            targets,
            probe_timeout=probe_timeout,
            poll_s=ctx.options.poll_s,
            check_alive=ctx.supervisor.check_required,
            on_progress=progress,
            prober=prober,
        )
    except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
        raise RunFailed("readiness", str(exc)) from None
    ctx.timings.mark("lanes_ready", ctx.launched_at)
    ctx.timings.mark("lanes_ready_since_start", ctx.t0)
    ctx.timings.marks["lanes_ready_at_epoch"] = time.time()
    return seconds
