"""Cleanup that Slurm cannot confirm is a failed cleanup, never a clean one (no cluster needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmgate.runtime.ledger.reaper import stale_records
from slurmgate.runtime.ledger.records import RunRecord, RunStatus
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.supervisor import CleanupFailed
from slurmgate.runtime.spec.allocation import AllocationSpec

from .conftest import example_data


def test_attached_run_whose_steps_cannot_be_listed_ends_cleanup_failed_and_reapable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Attach mode, with the Slurm client gone from PATH: resolve fails, and cleanup cannot
    # list (let alone cancel) the run's steps in job 4242.
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    run = AllocationRun(AllocationSpec.from_data(example_data()), runs_root=tmp_path, log=print)
    with pytest.raises(CleanupFailed, match=r"allocation 4242: cleanup not verified: .*squeue"):
        run.run()
    record = json.loads(run.record_path.read_text())
    assert record["status"] == "cleanup-failed"
    assert not RunStatus(record["status"]).finished
    assert record["error"] and "SlurmError" in record["error"]  # the first failure is kept
    # Once the controller is gone, a reaper must still find it.
    record["controller_pid"] = 0
    assert [r.run_id for r in stale_records([RunRecord.model_validate(record)])] == [run.run_id]
