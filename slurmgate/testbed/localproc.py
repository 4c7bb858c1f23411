"""Processes a tool starts on this machine: a free loopback port, and stopping a process group."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
from typing import Any


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for a child to bind next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_below(top: int, host: str = "127.0.0.1", bottom: int = 20000) -> int:
    """A free port on `host` between `bottom` and `top`: below the ephemeral range, where no
    OS-assigned port of another process takes it in the meantime (Dynamo reads its system
    port as a signed 16-bit number, so its top is 32767)."""
    for _ in range(500):
        port = random.randint(bottom, top)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {bottom} and {top} on {host}")


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
