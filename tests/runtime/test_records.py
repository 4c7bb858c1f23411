"""Run records are typed: old files load, unknown keys survive, bad files are skipped (no Slurm)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.ledger.reaper import reap_stale_runs, stale_records
from slurmgate.runtime.ledger.records import MAX_RECORD_BYTES, RunStatus, load_records
from slurmgate.runtime.procs import process_start_ticks

# What a controller wrote before records were typed: no start time, no host, a numeric job id,
# and a key no current version knows.
OLD_RECORD: dict[str, Any] = {
    "run_id": "sg-old-1a2b3c4d",
    "name": "old",
    "job_id": 4242,
    "owned_allocation": False,
    "hosts": ["node1"],
    "phase": "readiness",
    "status": "running",
    "error": None,
    "controller_pid": 0,
    "steps": [{"name": "serve-chat", "pid": None, "pgid": None, "step_id": None}],
    "written_by": "an older slurmgate",
}


def write(root: Path, data: dict[str, Any] | str, name: str = "run") -> Path:
    path = root / name / "record.json"
    path.parent.mkdir(parents=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def dead_pid() -> int:
    """The pid of a process that has exited and been waited for."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_an_old_record_loads_with_its_fields_typed(tmp_path: Path) -> None:
    write(tmp_path, OLD_RECORD)
    (record,) = load_records(tmp_path)
    assert record.status is RunStatus.RUNNING and not record.status.finished
    assert record.job_id == "4242" and record.controller_host is None
    assert record.steps[0].name == "serve-chat" and record.steps[0].pgid is None
    assert record.path == tmp_path / "run" / "record.json"
    assert record.on_this_host()  # the oldest records name no host: they are this host's


def test_unknown_keys_survive_a_rewrite(tmp_path: Path) -> None:
    path = write(tmp_path, OLD_RECORD)
    (record,) = load_records(tmp_path)
    record.write()
    stored = json.loads(path.read_text())
    assert stored["written_by"] == "an older slurmgate"
    assert "reaped_at" not in stored  # a run never reaped keeps the layout it always had
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_unreadable_records_are_skipped_and_the_rest_load(tmp_path: Path) -> None:
    write(tmp_path, OLD_RECORD, "good")
    write(tmp_path, "{not json", "broken")
    write(tmp_path, {**OLD_RECORD, "status": "exploded"}, "unknown-status")
    write(tmp_path, json.dumps({**OLD_RECORD, "pad": "x" * MAX_RECORD_BYTES}), "huge")
    write(tmp_path, json.dumps([1, 2]), "a-list")
    assert [r.run_id for r in load_records(tmp_path)] == [OLD_RECORD["run_id"]]


@pytest.mark.parametrize(
    ("status", "finished"),
    [("running", False), ("cleanup-failed", False), ("clean", True), ("succeeded", True),
     ("failed", True), ("reaped", True)],
)  # fmt: skip
def test_only_runs_that_may_hold_slurm_resources_are_unfinished(
    status: str, finished: bool
) -> None:
    assert RunStatus(status).finished is finished


def test_the_reaper_marks_a_dead_run_and_keeps_what_it_did_not_write(tmp_path: Path) -> None:
    """A run with no job and no live process group needs no Slurm command to be reaped."""
    path = write(tmp_path, {**OLD_RECORD, "job_id": None, "controller_pid": dead_pid()})
    me = {"controller_pid": os.getpid(), "controller_started": process_start_ticks(os.getpid())}
    alive = write(tmp_path, {**OLD_RECORD, "run_id": "sg-alive", **me}, "alive")
    lines: list[str] = []
    records = load_records(tmp_path)
    assert [r.run_id for r in stale_records(records)] == [OLD_RECORD["run_id"]]
    tally = reap_stale_runs(records, info=lines.append)
    assert (tally.reaped, tally.deferred, tally.actions) == (1, 0, [])
    assert lines == [f"reap run={OLD_RECORD['run_id']} job=- nothing left "
                     "(allocation over, no live srun group)"]  # fmt: skip
    stored = json.loads(path.read_text())
    assert stored["status"] == "reaped" and stored["status_before_reap"] == "running"
    assert stored["reaped_by"]["host"] == socket.gethostname()
    assert stored["written_by"] == "an older slurmgate"
    assert json.loads(alive.read_text())["status"] == "running"  # a live controller owns it
    assert reap_stale_runs(load_records(tmp_path)).reaped == 0  # nothing left to do
