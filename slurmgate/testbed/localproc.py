"""Processes a tool starts on this machine: a free loopback port, and stopping a process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from typing import Any


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for a child to bind next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_group(proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """SIGTERM the process group `proc` leads, twice (Prefect turns the first into SIGINT), then
    SIGKILL whatever is left."""
    for sig in (signal.SIGTERM, signal.SIGTERM):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout / 2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)
