"""What every phase of a run shares: its spec, record, log, step environments and failures."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slurmgate.errors import ExternalError
from slurmgate.paths import default_runs_root
from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.engines.frontends import ServicePems
from slurmgate.runtime.hooks import HookOutcome, HookRunner, run_plain
from slurmgate.runtime.ledger.heartbeat import Heartbeat
from slurmgate.runtime.ledger.records import (
    RECORD_NAME,
    NodeFailure,
    NodeOutputs,
    RunRecord,
    RunStatus,
    StepRecord,
    controller_identity,
)
from slurmgate.runtime.run.credentials import RunCredentials, SecretResolver
from slurmgate.runtime.run.supervisor import CleanupReport, Supervisor
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.stepenv import step_env
from slurmgate.settings.handed import NODE_OUTPUTS_ROOT, inherited
from slurmgate.settings.runtime import OutputsSettings
from slurmgate.slurm import commands as slurm


class RunFailed(ExternalError):
    """A phase of the run failed; `phase` names it."""

    def __init__(self, phase: str, message: str) -> None:
        self.phase = phase
        super().__init__(f"{phase}: {message}")


def new_run_id(name: str) -> str:
    return f"sg-{name[:20]}-{secrets.token_hex(4)}"


@dataclass
class RunResult:
    """What a finished run reports."""

    run_id: str
    ok: bool
    error: str | None
    job_id: str | None
    hosts: list[str]
    timings: dict[str, float]
    endpoint_metrics: dict[str, str]
    cleanup: list[str]
    record_path: str
    hooks: dict[str, str] = field(default_factory=dict)  # hook name -> what it did, in words
    hooks_failed: list[str] = field(default_factory=list)  # hooks that did not succeed


@dataclass
class Timings:
    """A run's named marks: seconds since a phase's start, or wall-clock instants."""

    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, t0: float) -> None:
        self.marks[name] = round(time.monotonic() - t0, 4)


@dataclass(frozen=True)
class RunOptions:
    """How a run is carried out: where its files go, its interpreter, its time bounds."""

    run_id: str
    run_dir: Path
    python: str
    allocate_timeout_s: float = 300.0
    grace_s: float = 10.0
    poll_s: float = 0.1


@dataclass(eq=False)
class RunContext:
    """One run's context, handed to every phase: the spec and its plan, the options, the log,
    the supervisor of its steps, and what the phases learn and decide as the run goes.

    The phases read and write it; the record (`record.json`) is written from it at every
    phase (`save`). Nothing else about a run is shared between its phases.
    """

    spec: AllocationSpec
    options: RunOptions
    credentials: RunCredentials
    supervisor: Supervisor
    emit: Callable[[str], None]
    on_progress: Callable[[str, int, int], None] | None
    hook_runner: HookRunner
    redact: Callable[[str], str]
    plan: layout_mod.AllocationPlan
    t0: float = field(default_factory=time.monotonic)
    timings: Timings = field(default_factory=Timings)
    # The allocation: its job, whether this run made it (and must cancel it), its hosts.
    job_id: str | None = None
    owned_allocation: bool = False
    layout: layout_mod.Layout | None = None
    heartbeat: Heartbeat | None = None  # beats while this run owns an allocation
    # Where the run is, and how it ends.
    phase: str = "new"
    status: RunStatus = RunStatus.RUNNING
    error: str | None = None
    cleanup_report: CleanupReport | None = None
    # What the phases learned: the client's CPUs, when the lanes launched, hooks, metrics.
    client_cpus: int | None = None
    launched_at: float = 0.0
    hooks: dict[str, HookOutcome] = field(default_factory=dict)
    endpoint_metrics: dict[str, str] = field(default_factory=dict)
    # requests each stand-in worker served, by lane, read from it after the client
    lane_served: dict[str, float] = field(default_factory=dict)
    # Node failures (runtime/run/node_failures.py): nodes this attempt's allocation must avoid,
    # the attempt it retries, the phase it failed in, which steps had failed on their own by
    # then, the node it blamed and the attempt that retried it.
    excluded_nodes: list[str] = field(default_factory=list)
    retry_of: str | None = None
    failed_phase: str | None = None
    exits_at_failure: dict[str, int | None] = field(default_factory=dict)
    node_failure: NodeFailure | None = None
    retried_as: str | None = None
    # Per deployment whose etcd and NATS serve other nodes: the run's own CA and certificates
    # (run/service_certs.py). Held here only: never in the record.
    service_pems: dict[str, ServicePems] = field(default_factory=dict, repr=False)
    # What was collected from the nodes before cleanup (run/outputs.py), and how: the Prefect
    # layer hands its own collector of a list of hosts (a retryable task per node).
    outputs: list[NodeOutputs] = field(default_factory=list)
    outputs_upload: str | None = None
    collect_nodes: Callable[[list[str]], list[NodeOutputs]] | None = None

    @classmethod
    def open(
        cls,
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
    ) -> RunContext:
        """A new run's context, its directory made and its first record written."""
        # Resolved here, on the client host, before anything starts: an unknown reference
        # fails the run with nothing to clean up. The values live only in this process.
        credentials = RunCredentials.resolve(spec, resolve_secret)
        run_id = run_id or new_run_id(spec.name)
        options = RunOptions(
            run_id=run_id,
            run_dir=(runs_root or default_runs_root()) / run_id,
            python=python or spec.python or sys.executable,
            allocate_timeout_s=allocate_timeout_s,
            grace_s=grace_s,
            poll_s=poll_s,
        )
        redact = credentials.redactor()

        def changed(_: Supervisor) -> None:
            context.save()

        supervisor = Supervisor(
            options.run_dir, grace_s=grace_s, poll_s=0.1, on_change=changed, redact=redact
        )
        context = cls(
            spec=spec,
            options=options,
            credentials=credentials,
            supervisor=supervisor,
            emit=log or (lambda m: print(f"[slurmgate] {m}", file=sys.stderr, flush=True)),
            on_progress=on_progress,
            # Site hooks run on this host; without a runner from the Prefect layer, the core's.
            hook_runner=hook_runner or (lambda i: run_plain(i, lambda line: context.log(line))),
            redact=redact,
            plan=layout_mod.plan(spec),
            client_cpus=spec.client.cpus,
            excluded_nodes=list(exclude_nodes),
            retry_of=retry_of,
        )
        context.save()
        return context

    # -- who the run is ----------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.options.run_id

    @property
    def run_dir(self) -> Path:
        return self.options.run_dir

    @property
    def python(self) -> str:
        return self.options.python

    @property
    def record_path(self) -> Path:
        return self.run_dir / RECORD_NAME

    @property
    def client_reports_dir(self) -> Path:
        return self.run_dir / "client-reports"

    @property
    def outputs_dir(self) -> Path:
        """Where the run's collected logs and results go: one folder per node, `steps` and
        `client` (redacted and bounded: the copy to publish or upload)."""
        return self.run_dir / "outputs"

    @property
    def client_results_dir(self) -> Path:
        """The client's SLURMGATE_RESULTS_DIR, beside its reports; collected into outputs."""
        return self.run_dir / "client-results"

    # -- bookkeeping -------------------------------------------------------------------------

    def log(self, message: str) -> None:
        self.emit(self.redact(message))

    def record(self) -> RunRecord:
        report = self.cleanup_report
        return RunRecord(
            run_id=self.run_id,
            name=self.spec.name,
            job_id=self.job_id,
            owned_allocation=self.owned_allocation,
            hosts=list(self.layout.hosts) if self.layout else [],
            phase=self.phase,
            status=self.status,
            error=self.redact(self.error) if self.error else None,
            **controller_identity(),
            cleanup_complete=report.complete if report else None,
            hooks=dict(self.hooks),
            node_failure=self.node_failure,
            excluded_nodes=list(self.excluded_nodes),
            retry_of=self.retry_of,
            retried_as=self.retried_as,
            lane_served=dict(self.lane_served),
            outputs_dir=str(self.outputs_dir) if self.outputs else None,
            outputs=list(self.outputs),
            outputs_upload=self.outputs_upload,
            steps=[StepRecord(**step) for step in self.supervisor.records()],
        )

    def save(self) -> None:
        if self.run_dir.exists():
            self.record().write(self.record_path)

    def enter(self, phase: str) -> None:
        """The run is now in `phase`: recorded, then logged."""
        self.phase = phase
        self.save()
        self.log(f"phase {phase}")

    # -- steps -------------------------------------------------------------------------------

    def base_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """An allow-list of the controller's environment (no credentials, no Slurm step
        shape), then what the runtime and the spec set for this step."""
        bindir = str(Path(self.python).parent)
        named = {
            "PATH": bindir + os.pathsep + inherited().get("PATH", ""),
            "SLURMGATE_RUN_ID": self.run_id,
            "PYTHONUNBUFFERED": inherited().get("PYTHONUNBUFFERED", "1"),
        }
        # where the lanes leave their logs and results on each node, when the operator chose
        node_root = OutputsSettings.text("node_root")
        if node_root:
            named[NODE_OUTPUTS_ROOT] = node_root
        # slurm.environ adds the SLURM_CONF `slurmgate cluster up` recorded, when none is set:
        # srun needs it, and so does a step that runs Slurm commands itself.
        return step_env(slurm.environ(), {**named, **(extra or {})})

    def step_name(self, role: str) -> str:
        return f"{self.run_id}-{role}"
