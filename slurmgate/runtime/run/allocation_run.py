"""The run of one allocation: its phases in order over one context; cleanup has one owner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.hooks import HookOutcome, HookRunner
from slurmgate.runtime.ledger.heartbeat import Heartbeat
from slurmgate.runtime.ledger.records import NodeFailure, RunRecord, RunStatus
from slurmgate.runtime.run import allocate, client, endpoints, launch, preflight, site_hooks
from slurmgate.runtime.run.cleanup import Cleanup
from slurmgate.runtime.run.credentials import RunCredentials, SecretResolver
from slurmgate.runtime.run.probes import Probes
from slurmgate.runtime.run.state import RunContext, RunFailed, RunResult, new_run_id
from slurmgate.runtime.run.supervisor import DEFER, CleanupFailed, CleanupReport, Supervisor
from slurmgate.runtime.run.workers import client_worker_spec, worker_argv, worker_spec
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.steps import readiness
from slurmgate.runtime.steps.node_worker import WorkerSpec
from slurmgate.runtime.steps.probe_step import HELLO_TIMEOUT_S


class AllocationRun:
    """One run of an allocation spec; every phase is a method, cleanup has exactly one owner.

    Each phase is a function of its module in this package (`allocate`, `preflight`, `launch`,
    `endpoints`, `client`, `site_hooks`) or an object of its own (`Probes`, `Cleanup`), and
    each is handed the run's `RunContext` (`state.py`). This class puts them in order, and
    shows the context's state to the flow, which runs each phase as a subflow.
    """

    def __init__(
        self,
        spec: AllocationSpec,
        *,
        runs_root: Path | None = None,
        run_id: str | None = None,
        grace_s: float = 10.0,
        poll_s: float = 0.1,
        python: str | None = None,
        allocate_timeout_s: float = 300.0,
        log: Callable[[str], None] | None = None,
        on_progress: Callable[[str, int, int], None] | None = None,
        resolve_secret: SecretResolver | None = None,
        hook_runner: HookRunner | None = None,
        exclude_nodes: tuple[str, ...] = (),
        retry_of: str | None = None,
    ) -> None:
        self.context = RunContext.open(
            spec,
            runs_root=runs_root,
            run_id=run_id,
            grace_s=grace_s,
            poll_s=poll_s,
            python=python,
            allocate_timeout_s=allocate_timeout_s,
            log=log,
            on_progress=on_progress,
            resolve_secret=resolve_secret,
            hook_runner=hook_runner,
            exclude_nodes=exclude_nodes,
            retry_of=retry_of,
        )
        self.probes = Probes(self.context)
        self._cleanup = Cleanup(self.context)

    # -- the phases, in order ----------------------------------------------------------------

    def allocate(self) -> str:
        """Attach to SLURM_JOB_ID, or salloc one that this run owns and always cancels."""
        return allocate.allocate(self.context)

    def salloc_request(self) -> dict[str, Any]:
        """What `allocate` asks Slurm for when the run owns its allocation (`salloc_argv`)."""
        return allocate.salloc_request(self.context)

    def resolve(self) -> layout_mod.Layout:
        """Hosts in allocation order → a bound layout; the node count must match the plan."""
        return allocate.resolve(self.context)

    def prolog(self) -> None:
        """The site's prolog, once the hosts are known and before the preflight."""
        site_hooks.prolog(self.context)

    def preflight(self) -> None:
        """Client (zero GPU) first, then every node of every deployment; nothing heavy starts."""
        preflight.preflight(self.context)

    def launch(self) -> None:
        """The services the workers register with, then one coordinated srun per deployment."""
        launch.launch(self.context, self)

    def wait_ready(self) -> float:
        """Poll every lane head until ready; a dead step fails at once, a deadline fails late."""
        return launch.wait_ready(self.context, self)

    def start_endpoints(self) -> None:
        """One logical endpoint step per deployment on the client host; wait for /health 200."""
        endpoints.start_endpoints(self.context, self)

    def client_env(self) -> dict[str, str]:
        """The client's environment: the endpoints' URLs, its reports directory, its secrets."""
        return client.client_env(self.context)

    def run_client(self) -> int:
        """The client step on the client host; the run fails if it fails or a server dies."""
        return client.run_client(self.context)

    def collect_endpoint_metrics(self) -> dict[str, str]:
        """The endpoints' Prometheus text, fetched before they stop."""
        return client.collect_endpoint_metrics(self.context, self)

    def cleanup(self) -> CleanupReport:
        """Stop every step (reverse order), release an owned allocation, verify. Exactly once."""
        return self._cleanup.run()

    def epilog(self) -> None:
        """The site's epilog, after cleanup: its failure is reported, never raised."""
        site_hooks.epilog(self.context)

    def run_hook(self, name: str, extra: dict[str, str] | None = None) -> HookOutcome | None:
        """Run the spec's hook `name` on this host under its guard (None when unset)."""
        return site_hooks.run_hook(self.context, name, extra)

    # -- the probes (the phases that probe open them here: a subclass may wrap them) ---------

    def open_prober(
        self, lifetime_s: float, hello_timeout_s: float = HELLO_TIMEOUT_S
    ) -> readiness.Prober:
        return self.probes.open_prober(lifetime_s, hello_timeout_s)

    def shut_prober(self) -> None:
        self.probes.shut_prober()

    # -- the whole run -----------------------------------------------------------------------

    def until_ready(self) -> float:
        """Allocate, resolve, preflight and launch, then wait for every lane; its seconds."""
        self.allocate()
        self.resolve()
        self.prolog()
        self.preflight()
        self.launch()
        return self.wait_ready()

    def run(self) -> RunResult:
        """Every phase in order; cleanup on every path; a failed cleanup fails the run."""
        failure: BaseException | None = None
        try:
            self.until_ready()
            self.start_endpoints()
            self.run_client()
            self.collect_endpoint_metrics()
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.finish(failure)
        return self.result()

    def note_failure(self, failure: BaseException) -> None:
        """Record the first failure and the phase it hit (before cleanup moves the phase)."""
        ctx = self.context
        if ctx.error is None:
            ctx.failed_phase = ctx.phase
            # Before cleanup stops them: which steps had failed on their own (node_failures.py).
            ctx.exits_at_failure = {s.name: s.returncode() for s in ctx.supervisor.steps}
            ctx.error = ctx.redact(f"{type(failure).__name__}: {failure}")
            ctx.log(f"run failed in phase {ctx.phase}: {ctx.error}")
            ctx.save()

    def finish(self, failure: BaseException | None) -> None:
        """Cleanup, then settle the status; raises CleanupFailed if cleanup was incomplete."""
        ctx = self.context
        with DEFER.hold():
            if failure is not None:
                self.note_failure(failure)
            report = self.cleanup()
            if not report.complete:
                ctx.status = RunStatus.CLEANUP_FAILED
            else:
                ctx.status = RunStatus.FAILED if ctx.error else RunStatus.SUCCEEDED
            ctx.save()
        if not report.complete:
            raise CleanupFailed("cleanup left survivors: " + "; ".join(report.survivors))

    def result(self) -> RunResult:
        ctx = self.context
        return RunResult(
            run_id=ctx.run_id,
            ok=ctx.status == RunStatus.SUCCEEDED,
            error=ctx.error,
            job_id=ctx.job_id,
            hosts=list(ctx.layout.hosts) if ctx.layout else [],
            timings=dict(ctx.timings.marks),
            endpoint_metrics=dict(ctx.endpoint_metrics),
            cleanup=list(ctx.cleanup_report.actions if ctx.cleanup_report else []),
            record_path=str(ctx.record_path),
            hooks={name: outcome.describe() for name, outcome in ctx.hooks.items()},
            hooks_failed=[name for name, outcome in ctx.hooks.items() if not outcome.ok],
        )

    # -- the run's state, as its context holds it --------------------------------------------

    def record(self) -> RunRecord:
        return self.context.record()

    def save(self) -> None:
        self.context.save()

    def log(self, message: str) -> None:
        self.context.log(message)

    def redact(self, text: str) -> str:
        return self.context.redact(text)

    @property
    def cleaned(self) -> bool:
        return self._cleanup.cleaned

    @property
    def probe_origin(self) -> str | None:
        return self.probes.origin

    @property
    def spec(self) -> AllocationSpec:
        return self.context.spec

    @property
    def plan(self) -> layout_mod.AllocationPlan:
        return self.context.plan

    @property
    def credentials(self) -> RunCredentials:
        return self.context.credentials

    @property
    def supervisor(self) -> Supervisor:
        return self.context.supervisor

    @property
    def run_id(self) -> str:
        return self.context.run_id

    @property
    def run_dir(self) -> Path:
        return self.context.run_dir

    @property
    def python(self) -> str:
        return self.context.python

    @property
    def record_path(self) -> Path:
        return self.context.record_path

    @property
    def client_reports_dir(self) -> Path:
        return self.context.client_reports_dir

    @property
    def job_id(self) -> str | None:
        return self.context.job_id

    @job_id.setter
    def job_id(self, value: str | None) -> None:
        self.context.job_id = value

    @property
    def layout(self) -> layout_mod.Layout | None:
        return self.context.layout

    @layout.setter
    def layout(self, value: layout_mod.Layout | None) -> None:
        self.context.layout = value

    @property
    def owned_allocation(self) -> bool:
        return self.context.owned_allocation

    @property
    def phase(self) -> str:
        return self.context.phase

    @property
    def status(self) -> RunStatus:
        return self.context.status

    @property
    def error(self) -> str | None:
        return self.context.error

    @property
    def hooks(self) -> dict[str, HookOutcome]:
        return self.context.hooks

    @property
    def endpoint_metrics(self) -> dict[str, str]:
        return self.context.endpoint_metrics

    @property
    def excluded_nodes(self) -> list[str]:
        return self.context.excluded_nodes

    @property
    def retry_of(self) -> str | None:
        return self.context.retry_of

    @property
    def failed_phase(self) -> str | None:
        return self.context.failed_phase

    @property
    def exits_at_failure(self) -> dict[str, int | None]:
        return self.context.exits_at_failure

    @property
    def node_failure(self) -> NodeFailure | None:
        return self.context.node_failure

    @node_failure.setter
    def node_failure(self, value: NodeFailure | None) -> None:
        self.context.node_failure = value

    @property
    def retried_as(self) -> str | None:
        return self.context.retried_as

    @retried_as.setter
    def retried_as(self, value: str | None) -> None:
        self.context.retried_as = value

    @property
    def _heartbeat(self) -> Heartbeat | None:
        return self.context.heartbeat

    # -- the steps' making, for tests that check it without Slurm ----------------------------

    def worker_argv(self, name: str, mode: str, nodelist: list[str], gres: str | None) -> list[str]:
        """The srun of one node-worker step (`workers.worker_argv`)."""
        return worker_argv(self.context, name, mode, nodelist, gres)

    def interpreter_problem(self, log: str) -> str | None:
        """Why the node-side interpreter could not run, if that is the failure."""
        return preflight.interpreter_problem(self.context, log)

    def _worker_spec(self, d: layout_mod.DeploymentPlan) -> WorkerSpec:
        return worker_spec(self.context, d)

    def _client_worker_spec(self) -> WorkerSpec:
        return client_worker_spec(self.context)

    def _base_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return self.context.base_env(extra)


__all__ = ["AllocationRun", "RunFailed", "RunResult", "new_run_id"]
