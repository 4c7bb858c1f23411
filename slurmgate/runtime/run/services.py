"""Service lanes on the client host: etcd, NATS, Mooncake before the workers, then a frontend.

A deployment's service lanes come from `service_lanes.service_launches`: Dynamo's etcd and
NATS, which its workers register with, and Mooncake's master and metadata server
(`DeploymentSpec.mooncake`) start before the workers; the frontend (Dynamo's, sglang-router or
vllm-router in PD mode, `trtllm-serve disaggregated`) starts once every worker answers, and is
ready when it lists them (`frontends.frontend_ready`). Each group is one node-worker step on
the client host, so it is supervised (fail-fast) and stopped by cleanup like the model-server
lanes.

etcd and NATS listen on loopback when every lane of the deployment runs on the client host;
else on its address, admitting only clients with a certificate of the run's own CA
(`service_certs`), which each lane that needs one gets as 0600 files in its private directory.
Mooncake's have no authentication: on the client host's address only with the spec's
`mooncake.across_hosts`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from slurmgate.runtime.engines import frontends, mooncake, service_lanes
from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.run import discovery
from slurmgate.runtime.run.probes import ProbeOpener
from slurmgate.runtime.run.service_certs import deployment_pems
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.run.supervisor import StepFailed
from slurmgate.runtime.run.workers import container_needs, start_workers
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.node_worker import LaneSpec, NodeSpec, WorkerSpec
from slurmgate.runtime.steps.probe_step import ProbeStepFailed

SERVICE_STARTUP_S = 60.0  # etcd and NATS start in a second or two


def start_services(
    ctx: RunContext,
    probes: ProbeOpener,
    d: layout_mod.DeploymentPlan,
    *,
    frontend: bool,
    phase: str,
) -> bool:
    """Start the frontend (`frontend`) or the other services of `d` as one step on the
    client host and wait for them; False when `d` has none of that kind."""
    assert ctx.layout
    dspec = ctx.spec.deployments[d.index]
    launches = [
        s
        for s in service_lanes.service_launches(dspec, ctx.layout, d, deployment_pems(ctx, d))
        if (s.plan.name == "frontend") == frontend
    ]
    if not launches:
        return False
    kind = "frontend" if frontend else "services"
    name = f"{kind}-{d.name}"
    host = ctx.layout.client_host
    lanes = [
        LaneSpec(
            id=f"{d.name}-{s.plan.name}",
            argv=s.argv,
            gpus=[],
            delay_s=0.0,
            env=s.env,
            files=s.files,
            env_files=s.env_files,
        )
        for s in launches
    ]
    ports = sorted({p for s in launches for p in s.plan.ports})
    # The field's frontend (Dynamo's, a router) is part of the deployment's image, and runs in
    # its container, as srt-slurm runs it; etcd, NATS and Mooncake are the nodes' own.
    in_container = dspec.container if frontend else None
    needs = container_needs(ctx, dspec) if in_container else None
    spec = WorkerSpec(
        run_id=ctx.run_id,
        name=name,
        gpus_per_node=0,
        model_path=None,
        grace_s=min(ctx.options.grace_s, 10.0),
        nodes=[
            NodeSpec(
                host=host,
                ports=ports,
                lanes=lanes,
                address=ctx.layout.address(ctx.plan.client_node),
            )
        ],
        # the workers' setup script prepares the workers' nodes, not the frontend's
        container=dataclasses.replace(needs, setup_script=None) if needs else None,
    )
    ctx.log(f"decision: start {', '.join(s.plan.name for s in launches)} of {d.name} on {host}")
    env = {
        **service_lanes.service_env(dspec, ctx.layout),
        **discovery.env(ctx, dspec),
        **ctx.credentials.deployment_env[d.index],
    }
    start_workers(
        ctx,
        name,
        "serve",
        spec,
        [host],
        gres="none",
        env=ctx.base_env(env),
        required=True,
        deployment=dspec if in_container else None,
    )
    ctx.supervisor.resolve_step_ids(timeout=3.0)
    timeout = dspec.frontend.startup_timeout_s if frontend and dspec.frontend else SERVICE_STARTUP_S
    if in_container:
        timeout += in_container.import_allowance_s
    expected = layout_mod.expected_workers(dspec, d)
    address = ctx.layout.address(ctx.plan.client_node)
    # The probes run on the client host: etcd's, NATS's and Mooncake's health listeners are on
    # loopback. Mooncake's metadata server has no health path: it is up when its step is.
    frontend_type = dspec.frontend.type if dspec.frontend else ""
    targets = [
        readiness.Target(
            name=f"{d.name} {s.plan.name}",
            base_url=f"http://{frontends.service_probe_host(s.plan.name, address)}:"
            f"{s.plan.probe_port}",
            path=s.plan.readiness_path,
            deadline=time.monotonic() + timeout,
            models=False,
            accept=_rule(frontend_type, s.plan.name, expected),
        )
        for s in launches
        if s.plan.readiness_path
    ]
    try:
        readiness.wait_ready(
            targets,
            probe_timeout=1.0,
            poll_s=0.2,
            check_alive=ctx.supervisor.check_required,
            prober=probes.open_prober(timeout + 60.0),
        )
    except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
        raise RunFailed(phase, str(exc)) from None
    finally:
        # The next phase opens the prober for its own lifetime.
        probes.shut_prober()
    ctx.log(f"{kind} of {d.name} ready on {host}")
    return True


def _rule(frontend: str, service: str, expected: dict[str, int]) -> Any:
    """How a service's readiness answer is judged: a frontend lists its workers, etcd says it
    is healthy; NATS's /healthz needs a 200 only (no rule)."""
    if service == "frontend":
        return lambda body: frontends.frontend_ready(frontend, 200, body, expected)
    if service == "etcd":
        return lambda body: frontends.service_ready("etcd", 200, body)
    if service == mooncake.MASTER:
        return mooncake.master_ready
    return None
