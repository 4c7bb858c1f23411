"""Runtime test helpers: the example spec as data, a /proc scan for a run's leftovers, and
Slurm allocations and port holders made outside the runtime."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from slurmgate.slurm import commands as slurm

if TYPE_CHECKING:  # tests/prefect_server loads this file as a module of no package
    from .squeue_json import FakeSlurm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "specs" / "local-stub.yaml"


def example_data() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))


def processes_with(token: str) -> list[str]:
    """Live processes on any node whose command line or environment carries `token`."""
    found = []
    needle = token.encode()
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
            if stat[stat.rfind(b")") + 2 :].split()[0] == b"Z":
                continue
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
            found.append(f"{entry.name}: {shown}")
    return found


def assert_no_orphans(token: str, within: float = 5.0) -> None:
    """Every process of the run is gone (zombies aside) within a short bound."""
    deadline = time.monotonic() + within
    while True:
        left = processes_with(token)
        if not left:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"processes of {token} survived:\n" + "\n".join(left))
        time.sleep(0.1)


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    return tmp_path / "runs"


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    """`squeue` and `scancel` stand-ins first on PATH (squeue_json.FakeSlurm)."""
    from .squeue_json import FakeSlurm

    fake = FakeSlurm(tmp_path / "fake-slurm")
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    return fake


def job_gone(job_id: str | None, within: float = 20.0) -> bool:
    """The Slurm job ended (or was never known) within `within` seconds."""
    assert job_id
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        info = slurm.show_job(job_id)
        if info is None or not info.active:
            return True
        time.sleep(0.2)
    return False


def hosts_of(job_id: str) -> list[str]:
    info = slurm.show_job(job_id)
    assert info is not None, f"job {job_id} is unknown to Slurm"
    return slurm.show_hostnames(info.nodelist)


@pytest.fixture
def held_allocation() -> Iterator[Callable[..., str]]:
    """`held_allocation(nodes=3, gpus=8)` -> the id of an allocation made outside the runtime
    (as in a batch job), cancelled at the end."""
    jobs: list[str] = []

    def make(nodes: int = 3, gpus: int = 8) -> str:
        job = slurm.salloc_no_shell(nodes=nodes, job_name="sg-test-held", gpus_per_node=gpus)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        slurm.scancel(job)


@contextlib.contextmanager
def port_held(job_id: str, host: str, port: int) -> Iterator[None]:
    """A listener on `port` of `host`, in a step of the job, until the block ends."""
    # SO_REUSEADDR: a TIME_WAIT an earlier run left is no listener, and the preflight binds the
    # same way, so only a real listener is a conflict.
    code = (
        "import socket,time; s=socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('0.0.0.0',{int(port)})); s.listen(); print('bound', flush=True); "
        "time.sleep(120)"
    )
    holder = subprocess.Popen(
        slurm.srun_argv(
            [sys.executable, "-c", code],
            job_id=job_id,
            nodelist=[host],
            step_name="sg-test-port-holder",
            gres="none",
        ),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "bound"
        yield
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
