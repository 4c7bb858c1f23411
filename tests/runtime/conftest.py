"""Runtime test helpers: the example spec as data, and a /proc scan for a run's leftovers."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

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
