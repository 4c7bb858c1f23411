"""Reconcile reaps the Slurm leftovers of crashed allocation runs; live and finished runs stay."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmgate.flows.reconcile import reconcile
from slurmgate.runtime.ledger.records import RunRecord, load_records
from slurmgate.runtime.procs import process_start_ticks
from slurmgate.slurm import commands as slurm

from ..runtime.conftest import assert_no_orphans, processes_with

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "specs" / "local-stub.yaml"
SLURM_COMMANDS = ("scontrol", "squeue", "scancel", "sinfo", "salloc", "srun", "sbatch", "sacct")


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runs directory reconcile scans, as the allocation worker's $SLURMGATE_RUNS_DIR."""
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("SLURMGATE_RUNS_DIR", str(root))
    return root


class SlurmCalls:
    """Every Slurm command run from this process, recorded by shims that exec the real one."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def slurm_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmCalls:
    """Put recording shims for the Slurm commands first on PATH (the real commands still run)."""
    shims = tmp_path / "slurm-shims"
    shims.mkdir()
    log = tmp_path / "slurm-calls.log"
    for name in SLURM_COMMANDS:
        real = shutil.which(name)
        target = shims / name
        if real is None:
            continue  # absent here: the lookup fails as it would without the shims
        target.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        target.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ.get('PATH', '')}")
    return SlurmCalls(log)


@pytest.fixture
def emu(emulator_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A small idle fleet: the tick's GitHub half has nothing to do."""
    emulator = emulator_factory({"a": 2})
    monkeypatch.setenv("GITHUB_TOKEN", emulator.token)
    return emulator


async def tick(emu: Any, **params: Any) -> dict[str, Any]:
    return await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, **params)


def reap_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("reap")]


# -- a controller on the cluster --------------------------------------------------------------


def hanging_spec(tmp_path: Path) -> Path:
    """The example spec with chat's stub hanging, so the run sits in readiness with lanes up."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["deployments"][0]["env"] = {"SLURMGATE_STUB_HANG": "1"}
    path = tmp_path / "hang.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


LANES = 4  # the example spec: chat 2 replicas x 1 node, pipe 1 replica x 2 nodes


def stub_lanes(run_id: str) -> list[str]:
    return [p for p in processes_with(run_id) if "slurmgate.testbed.stub_server" in p]


@pytest.fixture
def controller(runs_root: Path, tmp_path: Path) -> Iterator[Any]:
    """`controller()` starts `python -m slurmgate.runtime.run run` and returns it with its
    record once its lanes are up in readiness; any run left is stopped at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start() -> tuple[subprocess.Popen[str], RunRecord]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
        argv = [sys.executable, "-m", "slurmgate.runtime.run", "run"]
        argv += [str(hanging_spec(tmp_path)), "--runs-dir", str(runs_root)]
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            records = load_records(runs_root)
            if records and records[0].phase == "readiness":
                run_id = records[0].run_id
                # every lane of both deployments is up (chat's two replicas hang, pipe's two
                # ranks answer); chat's second replica starts after a stagger, so count them
                while len(stub_lanes(run_id)) < LANES:
                    assert time.monotonic() < deadline, f"lanes never came up: {stub_lanes(run_id)}"
                    time.sleep(0.1)
                time.sleep(0.5)
                return proc, load_records(runs_root)[0]
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        raise AssertionError("controller never reached readiness")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def job_state(job_id: str) -> str:
    info = slurm.show_job(job_id)
    return info.state if info else "GONE"


def job_gone(job_id: str, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if job_state(job_id) not in {"RUNNING", "PENDING", "CONFIGURING"}:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slurm
async def test_tick_reaps_a_sigkilled_allocation_run(
    slurm_cluster: dict[str, str],
    runs_root: Path,
    controller: Any,
    emu: Any,
    slurm_calls: SlurmCalls,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    proc, record = controller()
    run_id, job_id = record.run_id, record.job_id
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    time.sleep(0.5)
    assert processes_with(run_id), "a SIGKILLed controller leaves its steps behind"
    assert job_state(job_id) == "RUNNING"
    assert load_records(runs_root)[0].status == "running"
    calls = len(slurm_calls.lines())  # the controller's own salloc and srun calls

    summary = await tick(emu)

    assert summary["reaped"] == 1 and summary["reap_deferred"] == 0 and summary["errors"] == 0
    assert job_gone(job_id)
    assert_no_orphans(run_id, within=15)
    stored = json.loads((runs_root / run_id / "record.json").read_text())
    assert stored["status"] == "reaped" and stored["status_before_reap"] == "running"
    assert any(a.startswith(f"scancel {job_id}") for a in stored["reap_actions"]), stored
    assert stored["reaped_by"]["pid"] == os.getpid()
    lines = reap_lines(caplog)
    assert lines and all(f"run={run_id} job={job_id}" in line for line in lines), lines
    assert len(lines) == len(stored["reap_actions"])  # one line per action
    assert f"scancel {job_id}" in slurm_calls.lines()[calls:]

    before = len(slurm_calls.lines())
    again = await tick(emu)
    assert again["reaped"] == 0 and again["reap_deferred"] == 0
    assert slurm_calls.lines()[before:] == []  # nothing stale: not one Slurm command


@pytest.mark.slurm
async def test_tick_leaves_a_live_controllers_run_alone(
    slurm_cluster: dict[str, str],
    runs_root: Path,
    controller: Any,
    emu: Any,
    slurm_calls: SlurmCalls,
) -> None:
    proc, record = controller()
    run_id, job_id = record.run_id, record.job_id
    lanes = processes_with(run_id)
    before = len(slurm_calls.lines())  # the controller's own salloc and srun calls

    summary = await tick(emu)

    assert summary["reaped"] == 0 and summary["reap_deferred"] == 0
    assert slurm_calls.lines()[before:] == []  # a live controller is known from /proc alone
    assert proc.poll() is None and job_state(job_id) == "RUNNING"
    assert processes_with(run_id) == lanes
    assert load_records(runs_root)[0].status == "running"
    proc.send_signal(signal.SIGTERM)  # the controller still owns its cleanup, and does it
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert load_records(runs_root)[0].status == "failed"
    assert job_gone(job_id)
    assert_no_orphans(run_id)


# -- crafted records: Slurm unavailable, switched off, already over ---------------------------


def dead_controller() -> dict[str, Any]:
    """The identity of a controller process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = process_start_ticks(proc.pid)
    proc.kill()
    proc.wait()
    assert started is not None and process_start_ticks(proc.pid) is None
    return {
        "controller_pid": proc.pid,
        "controller_started": started,
        "controller_host": socket.gethostname(),
    }


def write_record(runs_root: Path, run_id: str, **fields: Any) -> Path:
    record = {
        "run_id": run_id,
        "name": "crafted",
        "job_id": "999999",
        "owned_allocation": True,
        "hosts": [],
        "phase": "readiness",
        "status": "running",
        "error": None,
        "cleanup_complete": None,
        "steps": [],
        **dead_controller(),
        **fields,
    }
    path = runs_root / run_id / "record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record, indent=1))
    return path


def test_a_controller_counts_as_dead_once_it_exits_even_unwaited() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = process_start_ticks(proc.pid)
    assert started is not None and started == process_start_ticks(proc.pid)
    proc.kill()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}/stat").read_bytes().split(b") ")[1][:1] != b"Z":
        assert time.monotonic() < deadline, "the killed child never became a zombie"
        time.sleep(0.01)
    assert process_start_ticks(proc.pid) is None  # a zombie: exited, not yet waited for
    proc.wait()
    assert process_start_ticks(proc.pid) != started  # gone, or a new process on a reused pid


@pytest.mark.parametrize("broken", ["missing-slurm-conf", "no-slurm-commands"])
async def test_tick_succeeds_with_one_warning_when_slurm_is_unavailable(
    broken: str,
    runs_root: Path,
    emu: Any,
    slurm_calls: SlurmCalls,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    crashed = write_record(runs_root, "sg-crafted-crashed")
    finished = write_record(runs_root, "sg-crafted-finished", status="succeeded")
    finished_text = finished.read_text()
    if broken == "missing-slurm-conf":
        monkeypatch.setenv("SLURM_CONF", str(tmp_path / "absent" / "slurm.conf"))
    else:
        monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))

    t0 = time.monotonic()
    summary = await tick(emu)

    assert time.monotonic() - t0 < 25  # one command timeout (10 s) at most, not one per run
    assert summary["errors"] == 0 and summary["reaped"] == 0 and summary["reap_deferred"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    reap_warnings = [w for w in warnings if w.startswith("reap")]
    assert len(reap_warnings) == 1 and "\n" not in reap_warnings[0], reap_warnings
    # A SLURM_CONF naming no file is refused before any command runs (Slurm itself would
    # retry it for 60 s); a missing client is found missing at once.
    reason = "does not exist" if broken == "missing-slurm-conf" else "not found"
    assert "run=sg-crafted-crashed job=999999" in reap_warnings[0] and reason in reap_warnings[0]
    stored = json.loads(crashed.read_text())
    assert stored["status"] == "running" and stored["reap_failures"] == 1
    assert stored["reap_retry_at"] > time.time() + 20 and reason in stored["reap_error"]
    assert finished.read_text() == finished_text  # a finished run is never touched
    if broken == "missing-slurm-conf":
        assert slurm_calls.lines() == []

    # The next tick, before the backoff ran out: no Slurm command, no new warning.
    caplog.clear()
    calls = len(slurm_calls.lines())
    again = await tick(emu)
    assert again["reaped"] == 0 and again["reap_deferred"] == 1 and again["errors"] == 0
    assert len(slurm_calls.lines()) == calls
    assert not reap_lines(caplog)


async def test_switched_off_the_tick_reads_no_record(
    runs_root: Path, emu: Any, slurm_calls: SlurmCalls
) -> None:
    crashed = write_record(runs_root, "sg-crafted-crashed")
    text = crashed.read_text()
    summary = await tick(emu, reap_allocations=False)
    assert summary["reaped"] == 0 and summary["reap_deferred"] == 0 and summary["errors"] == 0
    assert slurm_calls.lines() == [] and crashed.read_text() == text
    # and the same record is stale when the switch is on (the switch is what kept it)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", "/nonexistent")
        assert (await tick(emu))["reap_deferred"] == 1


@pytest.mark.slurm
async def test_a_crashed_run_whose_allocation_is_over_is_marked_reaped(
    slurm_cluster: dict[str, str],
    runs_root: Path,
    emu: Any,
    slurm_calls: SlurmCalls,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO)
    crashed = write_record(runs_root, "sg-crafted-over", job_id="999999")
    monkeypatch.setenv("SLURMGATE_RUNS_DIR", str(tmp_path / "elsewhere"))  # the parameter wins
    summary = await tick(emu, runs_dir=str(runs_root))
    assert summary["reaped"] == 1 and summary["reap_deferred"] == 0
    assert [line.split()[0] for line in slurm_calls.lines()] == ["squeue"]  # no scancel
    stored = json.loads(crashed.read_text())
    assert stored["status"] == "reaped" and stored["reap_actions"] == []
    assert reap_lines(caplog) == [
        "reap run=sg-crafted-over job=999999 nothing left (allocation over, no live srun group)"
    ]
