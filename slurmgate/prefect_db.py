"""An empty Prefect home starts from a copy of an already migrated database, when one is set."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

from slurmgate.settings.prefect import PrefectSettings

DATABASE_NAME = "prefect.db"  # Prefect's SQLite file in its home, unless a URL says otherwise


def seed_prefect_database(prefect_home: Path, name: str = DATABASE_NAME) -> bool:
    """Copy $SLURMGATE_PREFECT_DB_TEMPLATE to `prefect_home/name` when that file does not exist.

    A fresh SQLite database costs a Prefect server about 10 s of migrations (CPU, not disk) each
    time it starts in a new home; a copy of one migrated by the same Prefect version is what the
    migrations would have written. Nothing happens without the setting, or when the home already
    has a database; a template that is not a migrated SQLite database is ignored, so the server
    migrates as always. Returns whether a copy was made.
    """
    template = PrefectSettings.text("database_template")
    if not template:
        return False
    source = Path(template).expanduser()
    target = prefect_home / name
    if target.exists() or not migrated(source):
        return False
    prefect_home.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, target)  # a server never opens half a copy
    except OSError:
        partial.unlink(missing_ok=True)
        return False
    return True


def _is_sqlite(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            head = file.read(16)
    except OSError:
        return False
    return head == b"SQLite format 3\x00"


def migrated(path: Path) -> bool:
    """Whether `path` is a SQLite database that Prefect's migrations have run on."""
    if not _is_sqlite(path):
        return False
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return False
    return row is not None
