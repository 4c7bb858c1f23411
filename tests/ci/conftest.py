"""Fixtures for the CI-integration tests: the data folder and an in-process CLI runner."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def data() -> Path:
    return DATA


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """A CLI runner with the flags and GitHub run variables cleared; tests set what they need."""
    for name in (
        "PRIORITY_SCHEDULER_ENABLED",
        "NODE_SLOT_SCHEDULER_ENABLED",
        "GITHUB_RUN_ID",
        "GITHUB_RUN_ATTEMPT",
        "GITHUB_EVENT_NAME",
        "GITHUB_OUTPUT",
        "SLURMGATE_SKIP_QUEUE_PR",
    ):
        monkeypatch.delenv(name, raising=False)
    return CliRunner()
