"""A login node that hides other users' processes (`/proc` mounted with `hidepid=2`): the
reaper, running as a non-root Slurm operator, must not take a live controller for a dead one."""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import subprocess
import sys
import time

import pytest

from slurmgate.runtime.ledger.comment import ProcessIdentity
from slurmgate.runtime.ledger.reaper import _controller_gone
from slurmgate.runtime.procs import process_start_ticks

OPERATOR = "sgoperator"
CLONE_NEWNS = 0x00020000

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not sys.platform.startswith("linux") or shutil.which("mount") is None,
    reason="needs root to make a mount namespace and a second Unix user",
)


def _operator_uid() -> int:
    if subprocess.run(["id", OPERATOR], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OPERATOR], check=True
        )
    return pwd.getpwnam(OPERATOR).pw_uid


def _as_operator_behind_hidepid(uid: int, controllers: list[ProcessIdentity]) -> list[bool]:
    """`_controller_gone` of each controller, asked by a child that drops to `uid` inside a
    private mount namespace whose /proc is mounted with hidepid=2."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: this interpreter and its modules are loaded already
        try:
            os.close(read)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNS) != 0:
                os._exit(3)
            # private first, so the new /proc cannot propagate back to the host's namespace
            subprocess.run(["mount", "--make-rprivate", "/"], check=True)
            subprocess.run(["mount", "-t", "proc", "-o", "hidepid=2", "proc", "/proc"], check=True)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            answers = [_controller_gone(c) for c in controllers]
            os.write(write, ("".join("1" if a else "0" for a in answers)).encode())
            os._exit(0)
        except BaseException:
            os._exit(4)
    os.close(write)
    out = os.read(read, 64).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    return [c == "1" for c in out]


def test_a_hidden_live_controller_is_alive_and_a_dead_one_is_gone() -> None:
    uid = _operator_uid()
    live = subprocess.Popen(["sleep", "120"])  # root's controller: hidden from the operator
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        deadline = time.monotonic() + 10
        while (started := process_start_ticks(live.pid)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        host = os.uname().nodename
        controllers = [
            ProcessIdentity(pid=live.pid, started=started, host=host),
            ProcessIdentity(pid=dead.pid, started=started, host=host),
        ]
        # as root, without hidepid: the live one is alive, the dead one gone
        assert [_controller_gone(c) for c in controllers] == [False, True]
        # as the operator behind hidepid=2: the same answers, not "every hidden pid is gone"
        assert _as_operator_behind_hidepid(uid, controllers) == [False, True]
    finally:
        live.kill()
        live.wait()
    # the host's /proc was not touched
    with open("/proc/self/mountinfo") as mounts:
        assert "hidepid" not in mounts.read()
