"""Hostile run records: a reaper acts only on this user's own records, and says what it skipped."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from slurmgate.runtime.ledger.reaper import reap_stale_runs
from slurmgate.runtime.ledger.records import RECORD_NAME, RunRecord, load_records

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "sg-planted-0badc0de"
NOBODY = 65534


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process group whose command line happens to carry the planted run id."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", RUN_ID, f"{RUN_ID}-serve-chat"],
        start_new_session=True,
    )
    deadline = time.monotonic() + 5
    while RUN_ID.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        # right after exec the new command line can read empty for a moment
        assert time.monotonic() < deadline, "the victim never showed its command line"
        time.sleep(0.01)
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _plant(root: Path, pgid: int, *, mode: int = 0o600, owner: int | None = None) -> Path:
    """A stale record (dead controller, no Slurm job) that names `pgid` as its srun's group."""
    run_dir = root / RUN_ID
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECORD_NAME
    path.write_text(
        json.dumps(
            {
                "run_id": RUN_ID,
                "status": "running",
                "controller_pid": 2**22 + 1,  # above pid_max's default: never alive
                "controller_started": 1,
                "steps": [
                    {"name": "serve-chat", "pgid": pgid, "step_name": f"{RUN_ID}-serve-chat"}
                ],
            }
        )
    )
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def _reap(root: Path) -> tuple[list[str], list[str]]:
    warnings: list[str] = []
    records = load_records(root, warn=warnings.append)
    tally = reap_stale_runs(records, wait_out_backoff=False)
    return tally.actions, warnings


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_a_record_planted_by_another_user_never_kills_anything(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    path = _plant(tmp_path, victim.pid, owner=NOBODY)
    actions, warnings = _reap(tmp_path)
    time.sleep(0.2)
    assert victim.poll() is None, "the reaper killed a group named by a record it did not write"
    assert actions == []
    assert warnings == [
        f"run record skipped, its leftovers will not be reaped: {path}: UntrustedRecord: "
        f"{path} belongs to uid {NOBODY}, not to this user"
    ]


def test_a_record_others_can_write_is_not_trusted(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    path = _plant(tmp_path, victim.pid, mode=0o666)
    actions, warnings = _reap(tmp_path)
    assert victim.poll() is None and actions == []
    assert len(warnings) == 1 and "writable by group or others (mode 666)" in warnings[0]
    assert str(path) in warnings[0]


def test_a_symlinked_record_is_not_followed(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    elsewhere = _plant(tmp_path / "elsewhere", victim.pid)
    run_dir = tmp_path / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / RECORD_NAME).symlink_to(elsewhere)
    actions, warnings = _reap(tmp_path / "runs")
    assert victim.poll() is None and actions == []
    assert len(warnings) == 1 and "OSError" in warnings[0] and str(run_dir) in warnings[0]


def test_the_reaper_still_kills_the_group_its_own_record_names(
    tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    # The same record, written by this user with 0600: the group is the run's, and goes.
    _plant(tmp_path, victim.pid)
    actions, warnings = _reap(tmp_path)
    assert warnings == []
    assert actions == [f"SIGKILL group {victim.pid} (serve-chat)"]
    assert victim.wait(timeout=5) == -signal.SIGKILL


def test_writing_a_record_replaces_a_planted_link_instead_of_writing_through_it(
    tmp_path: Path,
) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    run_dir = tmp_path / RUN_ID
    run_dir.mkdir()
    (run_dir / RECORD_NAME).symlink_to(target)
    # a temp name a writer could be predicted to use (this process's pid), planted in advance
    predictable = run_dir / f"{RECORD_NAME}.tmp-{os.getpid()}"
    predictable.symlink_to(target)
    RunRecord(run_id=RUN_ID).write(run_dir / RECORD_NAME)
    assert target.read_text() == "keep me"
    written = run_dir / RECORD_NAME
    assert not written.is_symlink() and json.loads(written.read_text())["run_id"] == RUN_ID
    assert written.stat().st_mode & 0o777 == 0o600
    # no temp file is left behind, and the planted link was never used
    assert sorted(p.name for p in run_dir.iterdir()) == [RECORD_NAME, predictable.name]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_scheduled_reap_logs_every_record_it_cannot_use(tmp_path: Path) -> None:
    from slurmgate.tasks.allocation import reap_crashed_allocations

    broken = tmp_path / "sg-broken-00000000" / RECORD_NAME
    broken.parent.mkdir()
    broken.write_text("{not json")
    os.chmod(broken, 0o600)
    logger = logging.getLogger("test.reap")
    handler = _Lines()
    logger.addHandler(handler)
    try:
        tally = reap_crashed_allocations(logger, tmp_path)
    finally:
        logger.removeHandler(handler)
    assert tally.reaped == 0
    (line,) = handler.lines
    assert line.startswith(f"run record skipped, its leftovers will not be reaped: {broken}: ")
    assert "JSONDecodeError" in line


def test_a_record_artifact_that_cannot_be_published_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from slurmgate.runtime.run.allocation_run import AllocationRun
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.tasks.allocation import publish_record
    from slurmgate.testbed.localproc import free_port

    data = yaml.safe_load((REPO / "examples" / "specs" / "local-stub.yaml").read_text())
    run = AllocationRun(AllocationSpec.from_data(data), runs_root=tmp_path)
    nobody_listens = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings({PREFECT_API_URL: nobody_listens, PREFECT_CLIENT_MAX_RETRIES: 0}):
        publish_record(run)
    err = capsys.readouterr().err
    assert f"run {run.run_id}: the allocation-record artifact was not published: " in err
