"""Node-worker steps: what each node's worker is told, and the srun that starts it."""

from __future__ import annotations

from typing import Any

from slurmgate.runtime.engines import frontends, service_lanes
from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.run import containers, discovery, stand_ins
from slurmgate.runtime.run.service_certs import deployment_pems
from slurmgate.runtime.run.state import RunContext
from slurmgate.runtime.spec.deployment import DeploymentSpec
from slurmgate.runtime.steps.in_container import ContainerNeeds
from slurmgate.runtime.steps.node_worker import LaneSpec, NodeSpec, WorkerSpec
from slurmgate.slurm import commands as slurm


def worker_spec(ctx: RunContext, d: layout_mod.DeploymentPlan) -> WorkerSpec:
    assert ctx.layout
    dspec = ctx.spec.deployments[d.index]
    # Dynamo's workers reach etcd and NATS on other nodes with the run's client certificate.
    pems = deployment_pems(ctx, d)
    model_dir = stand_ins.model_dir(ctx, dspec)
    nodes = []
    for n in d.nodes:
        lanes = []
        address = ctx.layout.address(n.node)
        for lane in n.lanes:
            if lane.mpi:
                continue  # its MPI world's own step starts it (`mpi_world_spec`)
            master = ctx.layout.address(lane.rendezvous_node)
            argv = layout_mod.lane_argv(
                dspec, lane, master, bind_host=address, model_dir=model_dir or "MODEL"
            )
            # The deployment's env travels in the step's environment, never in argv
            # (argv is world-readable in /proc and may hold tokens); a lane's own env is
            # what its engine needs per node (the address it advertises) and its role's.
            env = layout_mod.lane_env(dspec, lane, address)
            files = layout_mod.lane_files(dspec, lane)
            # Mooncake's addresses and the store's JSON, in the lane's private directory
            mooncake_env, mooncake_files = service_lanes.mooncake_lane(
                dspec, ctx.layout, d, address
            )
            env |= mooncake_env
            files = {**files, **mooncake_files}
            env_files: dict[str, str] = {}
            if pems is not None:
                env |= frontends.client_auth_env()
                env_files = frontends.client_auth_env_files()
            lanes.append(layout_lane(lane, argv, env, files, env_files))
        nodes.append(
            NodeSpec(
                host=ctx.layout.host(n.node), ports=list(n.ports), lanes=lanes, address=address
            )
        )
    return WorkerSpec(
        run_id=ctx.run_id,
        name=d.name,
        gpus_per_node=ctx.spec.gpus_per_node,
        model_path=ctx.spec.model_path,
        grace_s=min(ctx.options.grace_s, 10.0),
        nodes=nodes,
        model_paths=_command_model_paths(dspec) + ([model_dir] if model_dir else []),
        # every lane's copy of the client certificate, sent once
        shared_files=pems.client_files() if pems is not None else {},
        shared_tokens=discovery.prepare(ctx, dspec),
        container=container_needs(ctx, dspec),
    )


def oci_bundle(ctx: RunContext, dspec: DeploymentSpec) -> str | None:
    """The run's own OCI bundle of a deployment in Slurm's OCI containers, written once."""
    c = dspec.container
    if c is None or c.resolved_runtime != "oci":
        return None
    where = ctx.run_dir / "oci" / dspec.name
    if (where / "config.json").is_file():
        return str(where)  # written by this run's preflight
    return containers.write_oci_bundle(c, where, ctx.run_id)


def container_needs(ctx: RunContext, dspec: DeploymentSpec) -> ContainerNeeds | None:
    c = dspec.container
    return None if c is None else containers.needs(c, oci_bundle(ctx, dspec))


def mpi_world_spec(
    ctx: RunContext, d: layout_mod.DeploymentPlan, world: layout_mod.MpiWorld
) -> WorkerSpec:
    """What each rank of one MPI world is told: every node's one lane, the same argv on all
    (rendered for the head, whose rank 0 serves), the worker's GPUs on that node."""
    assert ctx.layout
    dspec = ctx.spec.deployments[d.index]
    head = world.head
    address = ctx.layout.address(head.rendezvous_node)
    argv = layout_mod.lane_argv(dspec, head, address, bind_host=address)
    env = layout_mod.lane_env(dspec, head, address)
    files = layout_mod.lane_files(dspec, head)
    nodes = [
        NodeSpec(
            host=ctx.layout.host(node),
            ports=[],  # the serve step's preflight checked the head's ports
            lanes=[layout_lane(head, argv, env, files)],
            address=ctx.layout.address(node),
        )
        for node in world.nodes
    ]
    return WorkerSpec(
        run_id=ctx.run_id,
        name=f"{d.name}-{world.name}",
        gpus_per_node=ctx.spec.gpus_per_node,
        model_path=ctx.spec.model_path,
        grace_s=min(ctx.options.grace_s, 10.0),
        nodes=nodes,
        container=container_needs(ctx, dspec),
    )


def mpi_world_argv(
    ctx: RunContext,
    name: str,
    nodelist: list[str],
    ranks_per_node: int,
    dspec: DeploymentSpec | None = None,
) -> list[str]:
    """The srun of one MPI world, as srt-slurm launches a TensorRT-LLM worker: Slurm's pmix
    plugin, a task per GPU, no CPU binding, fail-fast; each task a node worker in `rank` mode.
    `--overcommit` too: an allocation that holds fewer CPUs than GPUs on a node (one CPU per
    node, as the bundled cluster grants) still takes a rank per GPU."""
    argv, flags = _worker_command(ctx, "rank", dspec)
    return slurm.srun_argv(
        argv,
        job_id=ctx.job_id or "",
        nodelist=nodelist,
        step_name=ctx.step_name(name),
        tasks_per_node=ranks_per_node,
        mpi="pmix",
        extra=["--input=all", "--oversubscribe", "--overcommit", "--cpu-bind=none", *flags],
    )


def _worker_command(
    ctx: RunContext, mode: str, dspec: DeploymentSpec | None
) -> tuple[list[str], list[str]]:
    """The node worker's argv and the srun flags around it: in the deployment's container
    when it names one (its serve and rank steps; its preflight runs on the node itself)."""
    c = dspec.container if dspec is not None and mode != "preflight" else None
    if c is None:
        return [ctx.python, "-m", "slurmgate.runtime.steps.node_worker", mode, "--spec", "-"], []
    assert dspec is not None
    flags = containers.srun_flags(c, oci_bundle(ctx, dspec), ctx.run_id)
    return containers.worker_command(c, mode), flags


def client_worker_spec(ctx: RunContext) -> WorkerSpec:
    assert ctx.layout
    # the endpoints' ports, and the service lanes' (frontends, etcd, NATS)
    ports = sorted(
        {d.endpoint_port for d in ctx.plan.deployments}
        | {p for d in ctx.plan.deployments for s in d.services for p in s.ports}
    )
    return WorkerSpec(
        run_id=ctx.run_id,
        name="client",
        gpus_per_node=0,
        model_path=None,
        grace_s=1.0,
        # the frontends run here: their discovery directories must be shared with it too
        shared_tokens={
            k: v for dspec in ctx.spec.deployments for k, v in discovery.prepare(ctx, dspec).items()
        },
        nodes=[
            NodeSpec(
                host=ctx.layout.client_host,
                ports=ports,
                lanes=[],
                address=ctx.layout.address(ctx.plan.client_node),
            )
        ],
        container=_frontend_containers(ctx),
    )


def _frontend_containers(ctx: RunContext) -> ContainerNeeds | None:
    """What the client host's preflight checks for the frontends that run in a container:
    each container's image, bundle and mount sources, and the run's outputs folder it mounts."""
    needs = [
        container_needs(ctx, dspec)
        for dspec in ctx.spec.deployments
        if dspec.container is not None and dspec.frontend is not None
    ]
    if not needs:
        return None
    found = [n for n in needs if n is not None]
    paths = [p for n in found for p in n.host_paths]
    # no setup script on the client host: it prepares the workers' nodes
    return ContainerNeeds(runtime=found[0].runtime, host_paths=list(dict.fromkeys(paths)))


def worker_argv(
    ctx: RunContext,
    name: str,
    mode: str,
    nodelist: list[str],
    gres: str | None,
    dspec: DeploymentSpec | None = None,
) -> list[str]:
    """The srun of one node-worker step: one task per listed node, fail-fast.

    The serve steps of `launch` are exactly this with mode `serve` and the job's GPUs. A
    preflight step lets every node finish its checks (no fail-fast): a failure is then
    one node's only when every other node reported it passed.
    """
    argv, flags = _worker_command(ctx, mode, dspec)
    return slurm.srun_argv(
        argv,
        job_id=ctx.job_id or "",
        nodelist=nodelist,
        step_name=ctx.step_name(name),
        gres=gres,
        kill_on_bad_exit=mode != "preflight",
        extra=["--input=all", *flags],
    )


def start_workers(
    ctx: RunContext, name: str, mode: str, ws: WorkerSpec, nodelist: list[str], **step: Any
) -> Any:
    """One node-worker srun; its spec goes through stdin (to every task), never argv: the
    lanes' commands are the user's and argv is public in /proc."""
    gres = step.pop("gres")
    dspec = step.pop("deployment", None)
    return ctx.supervisor.start(
        name,
        worker_argv(ctx, name, mode, nodelist, gres, dspec),
        step_name=ctx.step_name(name),
        stdin_data=ws.encode().encode(),
        **step,
    )


def _command_model_paths(dspec: DeploymentSpec) -> list[str]:
    """The absolute model path the deployment's command loads, as its engine reads it, and
    every path under `/configs/` its env and flags name (srt-slurm's recipes mount their
    configs directory there; on the nodes it must exist as on srt-slurm's containers)."""
    path = engines.profile(dspec.engine).model_path(dspec.command)
    return [*([path] if path else []), *dspec.config_paths]


def layout_lane(
    lane: layout_mod.LanePlan,
    argv: list[str],
    env: dict[str, str],
    files: dict[str, str] | None = None,
    env_files: dict[str, str] | None = None,
) -> LaneSpec:
    return LaneSpec(
        id=lane.process_id,
        argv=argv,
        gpus=list(lane.gpus),
        delay_s=lane.delay_s,
        env=dict(env),
        files=dict(files or {}),
        env_files=dict(env_files or {}),
    )
