"""Cleanup: stop every step, release an owned allocation, verify; exactly once."""

from __future__ import annotations

import contextlib
import threading
import time

from slurmgate.runtime.ledger.records import RunStatus
from slurmgate.runtime.run import discovery, outputs
from slurmgate.runtime.run.site_hooks import epilog
from slurmgate.runtime.run.state import RunContext
from slurmgate.runtime.run.supervisor import DEFER, CleanupReport
from slurmgate.slurm import commands as slurm


class Cleanup:
    """The run's one cleanup, whatever failed, then the epilog."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._lock = threading.RLock()
        self._state = "open"  # open -> cleaning -> closed

    @property
    def cleaned(self) -> bool:
        return self._state == "closed"

    def run(self) -> CleanupReport:
        """Stop every step (reverse order), release an owned allocation, verify. Exactly once."""
        ctx = self.ctx
        if self._state == "cleaning":
            return ctx.cleanup_report or CleanupReport()
        # Signals wait until the allocation is released too; the first is re-raised after.
        with DEFER.hold(), self._lock:
            if self._state == "closed" and ctx.cleanup_report is not None:
                return ctx.cleanup_report
            self._state = "cleaning"
            prev_phase = ctx.phase
            ctx.phase = f"cleanup (after {prev_phase})"
            ctx.save()
            t0 = time.monotonic()
            if ctx.heartbeat is not None:
                ctx.heartbeat.stop()  # before the release: no beat on a cancelled job
            report = ctx.supervisor.cleanup()
            # the lanes are gone: Dynamo's discovery directories (a killed worker's records
            # stay in them) go with them
            report.actions += discovery.remove(ctx)
            # Inside the allocation still: every node's logs and results, each node under its
            # own time limit, before the release below takes the nodes away.
            report.actions += outputs.collect_all(ctx)
            ctx.cleanup_report = report
            try:
                if ctx.owned_allocation and not ctx.job_id:
                    # salloc failed or timed out: a request may still be pending under our name.
                    slurm.scancel_by_name(ctx.run_id)
                    report.actions.append(f"scancel --name={ctx.run_id} (no job id granted)")
                if ctx.job_id and ctx.owned_allocation:
                    self._release(report)
                elif ctx.job_id:
                    self._verify_steps_gone(report)
            except slurm.SlurmError as exc:
                # Unverified is not clean: the record must stay reapable and the run must fail.
                where = f"allocation {ctx.job_id}" if ctx.job_id else f"job name {ctx.run_id}"
                report.survivors.append(f"{where}: cleanup not verified: {exc}")
            finally:
                ctx.timings.mark("cleanup", t0)
                self._state = "closed"
                ctx.status = RunStatus.CLEAN if report.complete else RunStatus.CLEANUP_FAILED
                ctx.save()
            for action in report.actions:
                ctx.log(f"cleanup: {action}")
            ctx.log(
                f"cleanup {'complete' if report.complete else 'FAILED'} in {report.seconds:.2f} s"
            )
            epilog(ctx)  # bounded by its timeout; signals still wait
            return report

    def _release(self, report: CleanupReport) -> None:
        ctx = self.ctx
        assert ctx.job_id
        try:
            slurm.scancel(ctx.job_id)
            report.actions.append(f"scancel {ctx.job_id} (owned allocation)")
        except slurm.SlurmError as exc:
            report.survivors.append(f"allocation {ctx.job_id}: {exc}")
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = slurm.show_job(ctx.job_id)
            if info is None or info.state not in {"RUNNING", "PENDING", "CONFIGURING"}:
                report.actions.append(
                    f"allocation {ctx.job_id} {info.state if info else 'gone'} "
                    f"after {time.monotonic() - deadline + 20:.2f} s"
                )
                return
            time.sleep(0.1)
        report.survivors.append(f"allocation {ctx.job_id} still running 20 s after scancel")

    def _verify_steps_gone(self, report: CleanupReport) -> None:
        ctx = self.ctx
        assert ctx.job_id
        deadline = time.monotonic() + 10
        while True:
            mine = [s for s in slurm.list_steps(ctx.job_id) if s.name.startswith(ctx.run_id)]
            if not mine:
                return
            if time.monotonic() >= deadline:
                report.survivors += [f"step {s.step_id} ({s.name})" for s in mine]
                return
            for s in mine:
                with contextlib.suppress(slurm.SlurmError):
                    slurm.scancel(s.step_id)
            time.sleep(0.2)
