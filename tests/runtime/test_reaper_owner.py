"""The reaper cancels a record's job only while Slurm runs it as the record file's owner: a job
id a record names may since be another user's job, and a reaper that is root or a Slurm
operator could cancel it. Fed `squeue --all --json` by stand-in commands, no Slurm."""

from __future__ import annotations

import json
import os
import pwd
import socket
from pathlib import Path
from typing import Any

import pytest

from slurmgate.runtime.ledger.reaper import reap_stale_runs
from slurmgate.runtime.ledger.records import RECORD_NAME, RunRecord, load_records

from .squeue_json import FakeSlurm, job_22_05, job_24_05, listing_22_05, listing_24_05, text_22_05

ME = os.geteuid()
OTHER = ME + 1001  # a uid no record here belongs to


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _record(root: Path, run_id: str, job_id: str | None, *, owned: bool = True) -> Path:
    """A stale record of this user: its controller on this host is long dead."""
    path = root / run_id / RECORD_NAME
    path.parent.mkdir(parents=True)
    data: dict[str, Any] = {
        "run_id": run_id,
        "status": "running",
        "job_id": job_id,
        "owned_allocation": owned,
        "controller_pid": 2**22 + 1,  # above pid_max's default: never alive
        "controller_started": 1,
        "controller_host": socket.gethostname(),
        "steps": [],
    }
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    return path


def _listing(shape: str, *jobs: tuple[int, str, int]) -> str:
    """`squeue --all --json` of running jobs (id, name, uid) in `shape`."""
    if shape == "22.05":
        return text_22_05(
            listing_22_05(*(job_22_05(i, name, _user(uid), uid) for i, name, uid in jobs))
        )
    return json.dumps(
        listing_24_05(*(job_24_05(i, name, _user(uid), uid) for i, name, uid in jobs))
    )


@pytest.mark.parametrize("shape", ["22.05", "24.05"])
def test_a_records_job_that_slurm_runs_as_another_user_is_left_alone(
    fake_slurm: FakeSlurm, tmp_path: Path, shape: str
) -> None:
    root = tmp_path / "runs"
    mine = _record(root, "sg-mine-00000001", "4242")
    reused = _record(root, "sg-reused-00000002", "4243")  # the id now names another's job
    fake_slurm.listing(_listing(shape, (4242, "sg-mine-00000001", ME), (4243, "their-job", OTHER)))
    lines: list[str] = []
    tally = reap_stale_runs(load_records(root), wait_out_backoff=False, info=lines.append)

    assert fake_slurm.cancels() == [["4242"]]  # never 4243
    assert tally.reaped == 2 and tally.actions == ["scancel 4242 (owned allocation)"]
    left = (
        f"left job 4243 alone: Slurm runs it as user {_user(OTHER)} (uid {OTHER}), not as the "
        f"record's owner (uid {ME})"
    )
    assert lines == [
        "reap run=sg-mine-00000001 job=4242 scancel 4242 (owned allocation)",
        f"reap run=sg-reused-00000002 job=4243 {left}",
    ]
    # the run is over either way: its record says what was done, and what was not
    stored = json.loads(reused.read_text())
    assert stored["status"] == "reaped" and stored["reap_actions"] == [left]
    assert json.loads(mine.read_text())["reap_actions"] == ["scancel 4242 (owned allocation)"]
    # one listing for the whole pass, no scontrol: the listing says whose each job is
    assert [c for c in fake_slurm.calls() if c[0] != "scancel"] == [["squeue", "--all", "--json"]]


def test_the_steps_of_another_users_job_are_neither_listed_nor_cancelled(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    root = tmp_path / "runs"
    _record(root, "sg-attached-00000003", "5000", owned=False)
    _record(root, "sg-attached-00000004", "5001", owned=False)
    fake_slurm.listing(_listing("24.05", (5000, "their-batch", OTHER), (5001, "my-batch", ME)))
    # what `squeue -s -j JOB` prints, whichever job it is asked about
    fake_slurm.steps(
        "5000.0|sg-attached-00000003-serve\n5001.0|sg-attached-00000004-serve\n5001.1|mine\n"
    )
    lines: list[str] = []
    tally = reap_stale_runs(load_records(root), wait_out_backoff=False, info=lines.append)
    steps_asked = [c for c in fake_slurm.calls() if c[0] == "squeue" and "-s" in c]
    assert [c[c.index("-j") + 1] for c in steps_asked] == ["5001"]
    assert fake_slurm.cancels() == [["5001.0"]]
    assert tally.actions == ["scancel 5001.0 (sg-attached-00000004-serve)"]
    assert lines[0].startswith("reap run=sg-attached-00000003 job=5000 left job 5000 alone")


def test_a_run_granted_no_job_id_is_cancelled_by_name_among_its_owners_jobs(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    """Run by root or a Slurm operator, `scancel --name` alone cancels every user's jobs of
    that name."""
    root = tmp_path / "runs"
    _record(root, "sg-pending-00000005", None)
    fake_slurm.listing(_listing("22.05", (6000, "sg-pending-00000005", OTHER)))
    tally = reap_stale_runs(load_records(root), wait_out_backoff=False)
    assert fake_slurm.cancels() == [["--name=sg-pending-00000005", f"--user={_user(ME)}"]]
    assert tally.actions == ["scancel --name=sg-pending-00000005 (salloc had granted no job id)"]
    assert fake_slurm.calls()[0][0] == "scancel"  # no listing needed: there is no job id


def test_the_record_pass_and_the_all_users_pass_share_one_listing(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    root = tmp_path / "runs"
    _record(root, "sg-one-00000006", "7000")
    _record(root, "sg-two-00000007", "7001")
    fake_slurm.listing(_listing("24.05", (7000, "sg-one-00000006", ME)))
    tally = reap_stale_runs(load_records(root), wait_out_backoff=False, all_users=True)
    assert tally.reaped == 2 and fake_slurm.cancels() == [["7000"]]
    assert [c for c in fake_slurm.calls() if c[0] == "squeue"] == [["squeue", "--all", "--json"]]


def test_a_records_owner_is_the_files_never_a_key_of_it(tmp_path: Path) -> None:
    path = _record(tmp_path, "sg-keys-00000008", "8000")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "owner_uid": OTHER, "_owner_uid": OTHER}))
    (record,) = load_records(tmp_path)
    assert record.owner_uid == ME == path.stat().st_uid
    assert RunRecord(run_id="sg-new").owner_uid == ME  # never read: this process writes it
