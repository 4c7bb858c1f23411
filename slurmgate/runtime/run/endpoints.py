"""The logical endpoints: one step per deployment on the client host, up once /health is 200.

A disaggregated deployment's endpoint gets its lanes by role: each prefill worker's head with
its bootstrap port, and each decode worker's head. A deployment with a frontend gets it
started first (it lists every worker before it counts as ready), and its endpoint routes to
the frontend alone.
"""

from __future__ import annotations

import time
from typing import Any

from slurmgate.runtime.endpoint.config import TOKEN_ENV, EndpointConfig, PrefillBackend
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.run.probes import ProbeOpener
from slurmgate.runtime.run.services import start_services
from slurmgate.runtime.run.state import RunContext, RunFailed
from slurmgate.runtime.run.supervisor import StepFailed
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.probe_step import ProbeStepFailed
from slurmgate.slurm import commands as slurm

ENDPOINT_STARTUP_S = 60.0


def start_endpoints(ctx: RunContext, probes: ProbeOpener) -> None:
    """One logical endpoint step per deployment on the client host; wait for /health 200."""
    ctx.enter("endpoints")
    assert ctx.layout and ctx.job_id
    for d in ctx.plan.deployments:
        start_services(ctx, probes, d, frontend=True, phase="endpoints")
    targets = []
    for d in ctx.plan.deployments:
        dspec = ctx.spec.deployments[d.index]
        health_path = dspec.readiness_path
        if dspec.frontend is not None:
            # the field's own router pairs the roles; the endpoint fronts it alone
            address = ctx.layout.address(ctx.plan.client_node)
            lanes: dict[str, Any] = {"backends": [f"http://{address}:{dspec.frontend.port}"]}
            health_path = "/health"
        elif "prefill" in d.roles:
            # disaggregated: the endpoint pairs a prefill and a decode lane per request
            lanes = {
                "prefill": [
                    PrefillBackend(url=url, bootstrap_port=port)
                    for url, port in ctx.layout.prefill_bootstraps(d)
                ],
                "decode": ctx.layout.role_head_urls(d, "decode"),
            }
        else:
            lanes = {"backends": ctx.layout.head_urls(d)}
        config = EndpointConfig(
            name=d.name,
            host=ctx.layout.address(ctx.plan.client_node),
            port=d.endpoint_port,
            **lanes,
            max_waiting=dspec.backpressure.max_waiting_requests,
            retry_after=dspec.backpressure.retry_after_s,
            data_plane=dspec.endpoint_data_plane,
            backend_health_path=health_path,
            queue_waiting_metric=engines.profile(dspec.engine).queue.waiting,
            queue_running_metric=engines.profile(dspec.engine).queue.running,
        )
        argv = [ctx.python, "-m", "slurmgate.runtime.endpoint", *config.argv()]
        ctx.supervisor.start(
            f"endpoint-{d.name}",
            slurm.srun_argv(
                argv,
                job_id=ctx.job_id,
                nodelist=[ctx.layout.client_host],
                step_name=ctx.step_name(f"endpoint-{d.name}"),
                gres="none",
            ),
            env=ctx.base_env(token_env(ctx)),
            step_name=ctx.step_name(f"endpoint-{d.name}"),
            required=True,
        )
        targets.append(
            readiness.Target(
                name=f"endpoint {d.name}",
                base_url=ctx.layout.endpoint_url(d),
                deadline=time.monotonic() + ENDPOINT_STARTUP_S,
                models=False,
            )
        )
    ctx.supervisor.resolve_step_ids(timeout=3.0)
    try:
        readiness.wait_ready(
            targets,
            probe_timeout=1.0,
            poll_s=0.1,
            check_alive=ctx.supervisor.check_required,
            prober=probes.open_prober(ENDPOINT_STARTUP_S + 60.0),
        )
    except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
        raise RunFailed("endpoints", str(exc)) from None
    finally:
        probes.shut_prober()
    for d in ctx.plan.deployments:
        ctx.log(f"endpoint {d.name} ready at {ctx.layout.endpoint_url(d)}")


def token_env(ctx: RunContext) -> dict[str, str]:
    token = ctx.credentials.endpoint_token
    # The endpoints read it from there (never argv), and so does the client.
    return {TOKEN_ENV: token} if token else {}
