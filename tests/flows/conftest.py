"""Fixtures for the admission flow tests: one Prefect harness, the emulator, a private state dir."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _prefect(prefect_harness: None) -> None:
    """Every test here runs flows against the session's Prefect test server."""


@pytest.fixture(autouse=True)
def controller_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> dict[str, str]:
    """Flags on, no write pacing, a private ETag cache directory, a short orphan grace."""
    env = {
        "PRIORITY_SCHEDULER_ENABLED": "true",
        "NODE_SLOT_SCHEDULER_ENABLED": "true",
        "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
        "SLURMGATE_STATE_DIR": str(tmp_path / "state"),
        "SLURMGATE_ORPHAN_GRACE_S": "0",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def emulator_factory() -> Iterator[Any]:
    """`emulator_factory(pools, legacy=0, token=None)` -> a running emulator until teardown."""
    from contextlib import ExitStack

    from slurmgate.testbed.emulator.testing import running_emulator

    with ExitStack() as stack:

        def start(pools: dict[str, int], legacy: int = 0, token: str | None = None) -> Any:
            return stack.enter_context(running_emulator(pools, legacy, token))

        yield start
