"""Fixtures for the demo tests: the session's Prefect test server, the demo flags, a state dir."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def demo_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The flags the demo sets, no write pacing, and a private ETag cache directory."""
    from slurmgate.flows.demo import FLAGS

    for key, value in FLAGS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURMGATE_STATE_DIR", str(tmp_path / "state"))
