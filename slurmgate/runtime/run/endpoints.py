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
from slurmgate.runtime.run.services import ServiceSteps
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.run.supervisor import StepFailed
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.probe_step import ProbeStepFailed
from slurmgate.slurm import commands as slurm

ENDPOINT_STARTUP_S = 60.0


class EndpointsPhase(ServiceSteps):
    """The deployments' logical endpoints on the client host."""

    def start_endpoints(self) -> None:
        """One logical endpoint step per deployment on the client host; wait for /health 200."""
        self._enter("endpoints")
        assert self.layout and self.job_id
        for d in self.plan.deployments:
            self.start_services(d, frontend=True, phase="endpoints")
        targets = []
        for d in self.plan.deployments:
            dspec = self.spec.deployments[d.index]
            health_path = dspec.readiness_path
            if dspec.frontend is not None:
                # the field's own router pairs the roles; the endpoint fronts it alone
                address = self.layout.address(self.plan.client_node)
                lanes: dict[str, Any] = {"backends": [f"http://{address}:{dspec.frontend.port}"]}
                health_path = "/health"
            elif "prefill" in d.roles:
                # disaggregated: the endpoint pairs a prefill and a decode lane per request
                lanes = {
                    "prefill": [
                        PrefillBackend(url=url, bootstrap_port=port)
                        for url, port in self.layout.prefill_bootstraps(d)
                    ],
                    "decode": self.layout.role_head_urls(d, "decode"),
                }
            else:
                lanes = {"backends": self.layout.head_urls(d)}
            config = EndpointConfig(
                name=d.name,
                host=self.layout.address(self.plan.client_node),
                port=d.endpoint_port,
                **lanes,
                max_waiting=dspec.backpressure.max_waiting_requests,
                retry_after=dspec.backpressure.retry_after_s,
                backend_health_path=health_path,
                queue_waiting_metric=engines.profile(dspec.engine).queue.waiting,
                queue_running_metric=engines.profile(dspec.engine).queue.running,
            )
            argv = [self.python, "-m", "slurmgate.runtime.endpoint", *config.argv()]
            self.supervisor.start(
                f"endpoint-{d.name}",
                slurm.srun_argv(
                    argv,
                    job_id=self.job_id,
                    nodelist=[self.layout.client_host],
                    step_name=self._step_name(f"endpoint-{d.name}"),
                    gres="none",
                ),
                env=self._base_env(self._token_env()),
                step_name=self._step_name(f"endpoint-{d.name}"),
                required=True,
            )
            targets.append(
                readiness.Target(
                    name=f"endpoint {d.name}",
                    base_url=self.layout.endpoint_url(d),
                    deadline=time.monotonic() + ENDPOINT_STARTUP_S,
                    models=False,
                )
            )
        self.supervisor.resolve_step_ids(timeout=3.0)
        try:
            readiness.wait_ready(
                targets,
                probe_timeout=1.0,
                poll_s=0.1,
                check_alive=self.supervisor.check_required,
                prober=self.open_prober(ENDPOINT_STARTUP_S + 60.0),
            )
        except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
            raise RunFailed("endpoints", str(exc)) from None
        finally:
            self.shut_prober()
        for d in self.plan.deployments:
            self.log(f"endpoint {d.name} ready at {self.layout.endpoint_url(d)}")

    def _token_env(self) -> dict[str, str]:
        token = self.credentials.endpoint_token
        # The endpoints read it from there (never argv), and so does the client.
        return {TOKEN_ENV: token} if token else {}
