"""Cleanup: stop every step, release an owned allocation, verify; exactly once."""

from __future__ import annotations

import contextlib
import time

from slurmgate.runtime.ledger.records import RunStatus
from slurmgate.runtime.run.site_hooks import HookPhases
from slurmgate.runtime.run.supervisor import DEFER, CleanupReport
from slurmgate.slurm import commands as slurm


class CleanupPhase(HookPhases):
    """The run's one cleanup, whatever failed, then the epilog."""

    @property
    def cleaned(self) -> bool:
        return self._cleanup_state == "closed"

    def cleanup(self) -> CleanupReport:
        """Stop every step (reverse order), release an owned allocation, verify. Exactly once."""
        if self._cleanup_state == "cleaning":
            return self._cleanup_report or CleanupReport()
        # Signals wait until the allocation is released too; the first is re-raised after.
        with DEFER.hold(), self._cleanup_lock:
            if self._cleanup_state == "closed" and self._cleanup_report is not None:
                return self._cleanup_report
            self._cleanup_state = "cleaning"
            prev_phase = self.phase
            self.phase = f"cleanup (after {prev_phase})"
            self.save()
            t0 = time.monotonic()
            if self._heartbeat is not None:
                self._heartbeat.stop()  # before the release: no beat on a cancelled job
            report = self.supervisor.cleanup()
            self._cleanup_report = report
            try:
                if self.owned_allocation and not self.job_id:
                    # salloc failed or timed out: a request may still be pending under our name.
                    slurm.scancel_by_name(self.run_id)
                    report.actions.append(f"scancel --name={self.run_id} (no job id granted)")
                if self.job_id and self.owned_allocation:
                    self._release(report)
                elif self.job_id:
                    self._verify_steps_gone(report)
            except slurm.SlurmError as exc:
                # Unverified is not clean: the record must stay reapable and the run must fail.
                where = f"allocation {self.job_id}" if self.job_id else f"job name {self.run_id}"
                report.survivors.append(f"{where}: cleanup not verified: {exc}")
            finally:
                self.timings.mark("cleanup", t0)
                self._cleanup_state = "closed"
                self.status = RunStatus.CLEAN if report.complete else RunStatus.CLEANUP_FAILED
                self.save()
            for action in report.actions:
                self.log(f"cleanup: {action}")
            self.log(
                f"cleanup {'complete' if report.complete else 'FAILED'} in {report.seconds:.2f} s"
            )
            self.epilog()  # bounded by its timeout; signals still wait
            return report

    def _release(self, report: CleanupReport) -> None:
        assert self.job_id
        try:
            slurm.scancel(self.job_id)
            report.actions.append(f"scancel {self.job_id} (owned allocation)")
        except slurm.SlurmError as exc:
            report.survivors.append(f"allocation {self.job_id}: {exc}")
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = slurm.show_job(self.job_id)
            if info is None or info.state not in {"RUNNING", "PENDING", "CONFIGURING"}:
                report.actions.append(
                    f"allocation {self.job_id} {info.state if info else 'gone'} "
                    f"after {time.monotonic() - deadline + 20:.2f} s"
                )
                return
            time.sleep(0.1)
        report.survivors.append(f"allocation {self.job_id} still running 20 s after scancel")

    def _verify_steps_gone(self, report: CleanupReport) -> None:
        assert self.job_id
        deadline = time.monotonic() + 10
        while True:
            mine = [s for s in slurm.list_steps(self.job_id) if s.name.startswith(self.run_id)]
            if not mine:
                return
            if time.monotonic() >= deadline:
                report.survivors += [f"step {s.step_id} ({s.name})" for s in mine]
                return
            for s in mine:
                with contextlib.suppress(slurm.SlurmError):
                    slurm.scancel(s.step_id)
            time.sleep(0.2)
