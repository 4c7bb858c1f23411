"""The runs home follows the state home, and a reaper still finds runs left in the legacy home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmgate.paths import default_runs_root, legacy_runs_root, runs_roots, state_dir
from slurmgate.runtime.ledger.reaper import stale_records
from slurmgate.runtime.ledger.records import load_records

from .test_records import OLD_RECORD, dead_pid, write


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME, with neither home variable set."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLURMGATE_STATE_DIR", raising=False)
    monkeypatch.delenv("SLURMGATE_RUNS_DIR", raising=False)
    return tmp_path / "home"


def test_neither_set_keeps_both_homes_where_they_were(home: Path) -> None:
    assert state_dir() == home / ".cache" / "slurmgate"
    assert default_runs_root() == home / ".cache" / "slurmgate" / "runs" == legacy_runs_root()
    assert runs_roots() == [default_runs_root()]


def test_the_runs_home_follows_the_state_home(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMGATE_STATE_DIR", str(tmp_path / "state"))
    assert default_runs_root() == tmp_path / "state" / "runs"
    monkeypatch.setenv("SLURMGATE_RUNS_DIR", str(tmp_path / "elsewhere"))
    assert default_runs_root() == tmp_path / "elsewhere"  # the runs home named wins


def test_a_state_home_tilde_is_expanded(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_STATE_DIR", " ~/state ")
    assert state_dir() == home / "state" and default_runs_root() == home / "state" / "runs"


def test_the_legacy_home_is_read_only_while_it_exists_and_differs(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMGATE_STATE_DIR", str(tmp_path / "state"))
    assert runs_roots() == [tmp_path / "state" / "runs"]  # no legacy home: nothing more
    legacy_runs_root().mkdir(parents=True)
    assert runs_roots() == [tmp_path / "state" / "runs", legacy_runs_root()]


def test_a_live_run_in_the_legacy_home_stays_visible_to_the_reaper(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started before SLURMGATE_STATE_DIR moved the runs home: its controller dies after
    the move, and the next reap must still find its record where it was written."""
    dead = {**OLD_RECORD, "controller_pid": dead_pid(), "run_id": "sg-legacy-1"}
    write(legacy_runs_root(), dead, "sg-legacy-1")
    monkeypatch.setenv("SLURMGATE_STATE_DIR", str(tmp_path / "state"))
    new_home = default_runs_root()
    write(new_home, {**dead, "run_id": "sg-new-1"}, "sg-new-1")

    records = load_records()
    assert sorted(r.run_id for r in records) == ["sg-legacy-1", "sg-new-1"]
    assert sorted(r.run_id for r in stale_records(records)) == ["sg-legacy-1", "sg-new-1"]
    legacy = next(r for r in records if r.run_id == "sg-legacy-1")
    assert legacy.path == legacy_runs_root() / "sg-legacy-1" / "record.json"
    assert json.loads(legacy.path.read_text())["written_by"] == "an older slurmgate"
    # a runs root named explicitly is read alone, as before
    assert [r.run_id for r in load_records(new_home)] == ["sg-new-1"]
