"""This machine's processes as /proc shows them: which are alive, their groups, their start."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LiveProcess:
    """One process that has not exited, as /proc/PID/stat shows it."""

    pid: int
    ppid: int
    pgrp: int
    session: int


def live_processes() -> list[LiveProcess]:
    """Every process of this machine that has not exited (zombies left out), from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp session ...
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) >= 4 and rest[0] not in (b"Z", b"X"):
            found.append(LiveProcess(int(entry.name), int(rest[1]), int(rest[2]), int(rest[3])))
    return found


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22); None once it exited.

    With the pid it names one process for good: a reused pid has a later start time. A zombie
    (exited, not yet waited for) counts as exited.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields or fields[0] in {b"Z", b"X"}:
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def cmdline_contains(pid: int, token: str) -> bool:
    """The live process `pid` has `token` in its command line."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return token.encode() in cmdline


def group_alive(pgid: int) -> bool:
    """A live (non-zombie) process is in the group; zombies wait for a slow init to reap them."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(live_group_members(pgid)) if os.path.isdir("/proc/self") else True


def live_group_members(pgid: int) -> list[int]:
    """Non-zombie pids whose process group is `pgid`, read from /proc."""
    return [p.pid for p in live_processes() if p.pgrp == pgid]


def hidden_but_alive(pid: int) -> bool:
    """`pid` exists although /proc does not show it to this user.

    Login nodes often mount /proc with `hidepid=1` or `hidepid=2`: another user's /proc/PID is
    unreadable or absent, which reads like an exited process. The kernel still answers
    `kill(pid, 0)` with EPERM for a process that exists and is not ours.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb"):
            return False  # /proc shows it: what it says stands (a zombie has exited)
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return False  # ours and signalable, yet without /proc/PID/stat: it has just exited
