"""A job comment is written by the job's user: one that forges a line of `squeue`'s listing
must not steer root's all-users reaper to another user's job."""

from __future__ import annotations

import os
import pwd
import re
import socket
import subprocess
from pathlib import Path

import pytest

from slurmgate.runtime.ledger.comment import ProcessIdentity, job_comment
from slurmgate.runtime.ledger.reaper import reap_stale_runs
from slurmgate.runtime.ledger.records import RECORD_NAME, RunRecord, load_records
from slurmgate.slurm import commands as slurm

from .conftest import job_gone

pytestmark = pytest.mark.slurm

VICTIM, FORGER = "sgvictim", "sgforger"


def _user(name: str) -> None:
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True
        )


def _submit(user: str, name: str, comment: str) -> str:
    """A one-node job of `user` that sleeps, with `name` and `comment`; its job id."""
    # output to /dev/null and a world-writable cwd: a job that cannot open its log fails at
    # launch, and a failed job would pass for one the reaper cancelled
    argv = ["sbatch", "--parsable", "-N1", "-t", "00:03:00", "-J", name, "--comment", comment]
    argv += ["--output=/dev/null", "--error=/dev/null", "--chdir=/tmp"]
    out = subprocess.run(
        ["runuser", "-u", user, "--", *argv, "--wrap", "sleep 170"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "SLURM_CONF": os.environ["SLURM_CONF"], "HOME": "/"},
        cwd="/",
    )
    found = re.match(r"(\d+)", out.stdout.strip())
    assert out.returncode == 0 and found, out.stdout + out.stderr
    return found.group(1)


def test_a_comment_that_forges_a_squeue_line_cancels_no_one_elses_job(runs_root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("submits jobs as two other Unix users: needs root")
    for user in (VICTIM, FORGER):
        _user(user)
    # the victim's job: a name the forger knows, and no slurmgate comment at all
    victim_run = f"sg-victim-{os.getpid()}"
    victim = _submit(VICTIM, victim_run, "my own note")
    # the forger's comment: its own line, then a newline and a whole forged line of the
    # listing the reaper used to read (job id, name, user, state, comment, 0x1f apart) that
    # names the victim's job, with a comment whose controller on this host is long dead
    dead = ProcessIdentity(pid=4_000_000, started=1, host=socket.gethostname())
    forged_comment = job_comment(victim_run, dead)
    forged = "\x1f".join((victim, victim_run, VICTIM, "RUNNING", forged_comment))
    forger = _submit(FORGER, "sg-forger", f"x\n{forged}")
    try:
        listed = {j.job_id: j for j in slurm.jobs_of_all_users()}
        # the listing shows two jobs, each with its own name, user and whole comment
        assert listed[victim].user == VICTIM and listed[victim].comment == "my own note"
        assert listed[forger].user == FORGER and listed[forger].comment == f"x\n{forged}"
        assert listed[victim].user_id == pwd.getpwnam(VICTIM).pw_uid
        lines: list[str] = []
        tally = reap_stale_runs(load_records(runs_root), info=lines.append, all_users=True)
        assert tally.reaped == 0, lines
        for job in (victim, forger):
            info = slurm.show_job(job)
            assert info is not None and info.active, (job, lines)
    finally:
        for job in (victim, forger):
            slurm.scancel(job)
    assert job_gone(victim) and job_gone(forger)


def test_a_record_naming_another_users_job_cancels_nothing(runs_root: Path) -> None:
    """Root's reaper, a stale record of root's that names a victim's job by id (an id Slurm
    reused) and another by name: the victim's jobs survive."""
    if os.geteuid() != 0:
        pytest.skip("submits a job as another Unix user: needs root")
    _user(VICTIM)
    name = f"sg-victim-named-{os.getpid()}"
    victim = _submit(VICTIM, f"sg-victim-owned-{os.getpid()}", "my own note")
    named = _submit(VICTIM, name, "my own note")
    for run_id, job_id in ((f"sg-root-by-id-{os.getpid()}", victim), (name, None)):
        path = runs_root / run_id / RECORD_NAME
        path.parent.mkdir(parents=True)
        record = RunRecord(run_id=run_id, job_id=job_id, owned_allocation=True)
        # its controller on this host is long dead
        record.controller_pid, record.controller_started = 4_000_000, 1
        record.controller_host = socket.gethostname()
        record.write(path)
    try:
        lines: list[str] = []
        tally = reap_stale_runs(load_records(runs_root), info=lines.append)
        assert tally.reaped == 2, lines
        assert any(f"left job {victim} alone: Slurm runs it as user {VICTIM}" in x for x in lines)
        for job in (victim, named):
            info = slurm.show_job(job)
            assert info is not None and info.active, (job, lines)
    finally:
        for job in (victim, named):
            slurm.scancel(job)
    assert job_gone(victim) and job_gone(named)
