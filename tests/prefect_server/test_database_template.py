"""An empty Prefect home starts from the migrated template; a home with a database keeps it."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import httpx
import pytest

from slurmgate.prefect_db import migrated, seed_prefect_database
from slurmgate.testbed.prefect_server import running_prefect_server


def test_an_empty_home_gets_the_template_and_its_server_serves_from_it(tmp_path: Path) -> None:
    template = Path(os.environ["SLURMGATE_PREFECT_DB_TEMPLATE"])
    assert migrated(template), "the test command builds the template (tests/conftest.py)"
    home = tmp_path / "home"
    with running_prefect_server(tmp_path, prefect_home=home) as server:
        copied = home / "prefect.db"
        assert copied.exists()
        # the server wrote to the copy, not the template: a flow it creates is in the copy only
        created = httpx.post(f"{server.api_url}/flows/", json={"name": "seeded"}, timeout=30)
        created.raise_for_status()
    with sqlite3.connect(copied) as db:
        assert db.execute("SELECT name FROM flow").fetchall() == [("seeded",)]
    with sqlite3.connect(f"file:{template}?mode=ro", uri=True) as db:
        assert db.execute("SELECT count(*) FROM flow").fetchone() == (0,)


def test_a_home_with_a_database_keeps_it(tmp_path: Path) -> None:
    (tmp_path / "prefect.db").write_bytes(b"mine")
    assert not seed_prefect_database(tmp_path)
    assert (tmp_path / "prefect.db").read_bytes() == b"mine"


@pytest.mark.parametrize("template", ["missing.db", "not-sqlite.db", "unmigrated.db"])
def test_a_template_that_is_no_migrated_database_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    (tmp_path / "not-sqlite.db").write_text("SQLite? no")
    sqlite3.connect(tmp_path / "unmigrated.db").execute("CREATE TABLE t (x)").connection.close()
    monkeypatch.setenv("SLURMGATE_PREFECT_DB_TEMPLATE", str(tmp_path / template))
    home = tmp_path / "home"
    assert not seed_prefect_database(home)
    assert not (home / "prefect.db").exists()
