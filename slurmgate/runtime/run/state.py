"""What every phase of a run shares: its spec, record, log, step environments and failures."""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slurmgate.errors import ExternalError
from slurmgate.paths import default_runs_root
from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.hooks import HookOutcome, HookRunner, run_plain
from slurmgate.runtime.ledger.heartbeat import Heartbeat
from slurmgate.runtime.ledger.records import (
    RECORD_NAME,
    NodeFailure,
    RunRecord,
    RunStatus,
    StepRecord,
    controller_identity,
)
from slurmgate.runtime.run.credentials import RunCredentials, SecretResolver
from slurmgate.runtime.run.supervisor import CleanupReport, Supervisor
from slurmgate.runtime.spec.model import AllocationSpec
from slurmgate.runtime.stepenv import step_env
from slurmgate.runtime.steps import readiness
from slurmgate.settings.handed import inherited
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
class _Timings:
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, t0: float) -> None:
        self.marks[name] = round(time.monotonic() - t0, 4)


class RunState:
    """A run's state and bookkeeping; each phase of `AllocationRun` is a mixin over it."""

    launched_at: float

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
        self.spec = spec
        # Resolved here, on the client host, before anything starts: an unknown reference
        # fails the run with nothing to clean up. The values live only in this process.
        self.credentials = RunCredentials.resolve(spec, resolve_secret)
        self.redact = self.credentials.redactor()
        self.run_id = run_id or new_run_id(spec.name)
        self.run_dir = (runs_root or default_runs_root()) / self.run_id
        self.python = python or spec.python or sys.executable
        self.allocate_timeout_s = allocate_timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._log = log or (lambda m: print(f"[slurmgate] {m}", file=sys.stderr, flush=True))
        self._on_progress = on_progress
        self.plan = layout_mod.plan(spec)
        self.job_id: str | None = None
        self.owned_allocation = False
        self.layout: layout_mod.Layout | None = None
        self.phase = "new"
        self.status = RunStatus.RUNNING
        self.error: str | None = None
        self.endpoint_metrics: dict[str, str] = {}
        self.t0 = time.monotonic()
        self.timings = _Timings()
        self.supervisor = Supervisor(
            self.run_dir,
            grace_s=grace_s,
            poll_s=0.1,
            on_change=lambda _s: self.save(),
            redact=self.redact,
        )
        self.client_cpus: int | None = spec.client.cpus
        self.probe_origin: str | None = None
        self._prober: readiness.Prober | None = None
        self._close_prober: Callable[[], None] = lambda: None
        self._cleanup_lock = threading.RLock()
        self._cleanup_state = "open"
        self._cleanup_report: CleanupReport | None = None
        self._heartbeat: Heartbeat | None = None  # beats while this run owns an allocation
        # Site hooks run on this host; without a runner from the Prefect layer, the core's own.
        self._hook_runner = hook_runner or (
            lambda invocation: run_plain(invocation, lambda line: self.log(line))
        )
        self.hooks: dict[str, HookOutcome] = {}
        # Node failures (runtime/run/node_failures.py): nodes this attempt's allocation must avoid,
        # the attempt it retries, the node it blamed and the attempt that retried it.
        self.excluded_nodes = list(exclude_nodes)
        self.retry_of = retry_of
        self.failed_phase: str | None = None
        self.exits_at_failure: dict[str, int | None] = {}
        self.node_failure: NodeFailure | None = None
        self.retried_as: str | None = None
        self.save()

    # -- bookkeeping -----------------------------------------------------------------------

    def log(self, message: str) -> None:
        self._log(self.redact(message))

    @property
    def record_path(self) -> Path:
        return self.run_dir / RECORD_NAME

    @property
    def client_reports_dir(self) -> Path:
        return self.run_dir / "client-reports"

    def record(self) -> RunRecord:
        report = getattr(self, "_cleanup_report", None)
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
            hooks=dict(getattr(self, "hooks", {})),
            node_failure=getattr(self, "node_failure", None),
            excluded_nodes=list(getattr(self, "excluded_nodes", [])),
            retry_of=getattr(self, "retry_of", None),
            retried_as=getattr(self, "retried_as", None),
            steps=(
                [StepRecord(**step) for step in self.supervisor.records()]
                if hasattr(self, "supervisor")
                else []
            ),
        )

    def save(self) -> None:
        if self.run_dir.exists():
            self.record().write(self.record_path)

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.save()
        self.log(f"phase {phase}")

    def _base_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """An allow-list of the controller's environment (no credentials, no Slurm step
        shape), then what the runtime and the spec set for this step."""
        bindir = str(Path(self.python).parent)
        named = {
            "PATH": bindir + os.pathsep + inherited().get("PATH", ""),
            "SLURMGATE_RUN_ID": self.run_id,
            "PYTHONUNBUFFERED": inherited().get("PYTHONUNBUFFERED", "1"),
        }
        # slurm.environ adds the SLURM_CONF `slurmgate cluster up` recorded, when none is set:
        # srun needs it, and so does a step that runs Slurm commands itself.
        return step_env(slurm.environ(), {**named, **(extra or {})})

    def _step_name(self, role: str) -> str:
        return f"{self.run_id}-{role}"
