"""Launch and readiness: one srun per deployment, then every lane head polled until ready."""

from __future__ import annotations

import time

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.run.endpoints import ENDPOINT_STARTUP_S
from slurmgate.runtime.run.probes import ProbeSteps
from slurmgate.runtime.run.services import ServiceSteps
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.run.supervisor import StepFailed
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.probe_step import ProbeStepFailed


class LaunchPhase(ServiceSteps, ProbeSteps):
    """The deployments' serve steps, and the wait until every lane head is ready."""

    def launch(self) -> None:
        """The services the workers register with (Dynamo's etcd and NATS), then one
        coordinated srun per deployment, one node worker per node, fail-fast."""
        self._enter("launch")
        assert self.layout and self.job_id
        for d in self.plan.deployments:
            self.start_services(d, frontend=False, phase="launch")
        self.launched_at = time.monotonic()
        for d in self.plan.deployments:
            dspec = self.spec.deployments[d.index]
            nodelist = self.layout.nodelist(d)
            self.log(f"decision: launch {d.name} as one srun on {','.join(nodelist)}")
            self._start_workers(
                f"serve-{d.name}",
                "serve",
                self._worker_spec(d),
                nodelist,
                gres=None,
                env=self._base_env(
                    {
                        **layout_mod.service_env(dspec, self.layout),
                        **self.credentials.deployment_env[d.index],
                    }
                ),
                required=True,
            )
        self.supervisor.resolve_step_ids(timeout=3.0)
        self.save()

    def wait_ready(self) -> float:
        """Poll every lane head until ready; a dead step fails at once, a deadline fails late."""
        self._enter("readiness")
        assert self.layout
        targets: list[readiness.Target] = []
        for d in self.plan.deployments:
            dspec = self.spec.deployments[d.index]
            if not engines.profile(dspec.engine).lane_http:
                # Dynamo's workers answer no HTTP: their frontend lists them when it is ready
                continue
            models, lists_model = engines.profile(dspec.engine).models_probe(dspec.command)
            for lane, url in zip(d.heads, self.layout.head_urls(d), strict=True):
                targets.append(
                    readiness.Target(
                        name=lane.process_id,
                        base_url=url,
                        path=dspec.readiness_path,
                        deadline=self.launched_at + lane.delay_s + dspec.startup_timeout_s,
                        needed=dspec.ready_probes,
                        models=models,
                        lists_model=lists_model,
                    )
                )
        probe_timeout = min(d.probe_timeout_s for d in self.spec.deployments)

        def progress(ready: int, total: int) -> None:
            self.log(f"readiness: {ready}/{total} lane heads ready")
            if self._on_progress:
                self._on_progress("lanes", ready, total)

        # The probe step lives through the endpoints' start too: bound it by both.
        last = max((t.deadline for t in targets), default=time.monotonic()) - time.monotonic()
        try:
            prober = self.open_prober(last + ENDPOINT_STARTUP_S + 60.0)
            seconds = readiness.wait_ready(
                targets,
                probe_timeout=probe_timeout,
                poll_s=self.poll_s,
                check_alive=self.supervisor.check_required,
                on_progress=progress,
                prober=prober,
            )
        except (readiness.ReadinessTimeout, StepFailed, ProbeStepFailed) as exc:
            raise RunFailed("readiness", str(exc)) from None
        self.timings.mark("lanes_ready", self.launched_at)
        self.timings.mark("lanes_ready_since_start", self.t0)
        self.timings.marks["lanes_ready_at_epoch"] = time.time()
        return seconds
