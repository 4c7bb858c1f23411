"""One allocation run: allocate, preflight, launch, readiness, endpoints, client, cleanup."""

from __future__ import annotations

from slurmgate.runtime.ledger.records import RunStatus
from slurmgate.runtime.run.allocate import AllocatePhase
from slurmgate.runtime.run.cleanup import CleanupPhase
from slurmgate.runtime.run.client import ClientPhase
from slurmgate.runtime.run.launch import LaunchPhase
from slurmgate.runtime.run.preflight import PreflightPhase
from slurmgate.runtime.run.state import RunFailed, RunResult, new_run_id
from slurmgate.runtime.run.supervisor import DEFER, CleanupFailed


class AllocationRun(AllocatePhase, PreflightPhase, LaunchPhase, ClientPhase, CleanupPhase):
    """One run of an allocation spec; every phase is a method, cleanup has exactly one owner.

    Each phase lives in its module of this package, as a mixin over `RunState`; this class
    puts them in order.
    """

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
        if self.error is None:
            self.failed_phase = self.phase
            # Before cleanup stops them: which steps had failed on their own (node_failures.py).
            self.exits_at_failure = {s.name: s.returncode() for s in self.supervisor.steps}
            self.error = self.redact(f"{type(failure).__name__}: {failure}")
            self.log(f"run failed in phase {self.phase}: {self.error}")
            self.save()

    def finish(self, failure: BaseException | None) -> None:
        """Cleanup, then settle the status; raises CleanupFailed if cleanup was incomplete."""
        with DEFER.hold():
            if failure is not None:
                self.note_failure(failure)
            report = self.cleanup()
            if not report.complete:
                self.status = RunStatus.CLEANUP_FAILED
            else:
                self.status = RunStatus.FAILED if self.error else RunStatus.SUCCEEDED
            self.save()
        if not report.complete:
            raise CleanupFailed("cleanup left survivors: " + "; ".join(report.survivors))

    def result(self) -> RunResult:
        return RunResult(
            run_id=self.run_id,
            ok=self.status == RunStatus.SUCCEEDED,
            error=self.error,
            job_id=self.job_id,
            hosts=list(self.layout.hosts) if self.layout else [],
            timings=dict(self.timings.marks),
            endpoint_metrics=dict(self.endpoint_metrics),
            cleanup=list(self._cleanup_report.actions if self._cleanup_report else []),
            record_path=str(self.record_path),
            hooks={name: outcome.describe() for name, outcome in self.hooks.items()},
            hooks_failed=[name for name, outcome in self.hooks.items() if not outcome.ok],
        )


__all__ = ["AllocationRun", "RunFailed", "RunResult", "new_run_id"]
