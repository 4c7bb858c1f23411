"""scripts/postgres-local.sh: a throw-away PostgreSQL that a Prefect server can use.

The real PostgreSQL from Debian's package: start prints an asyncpg URL that answers, start again
is idempotent (and a new SLURMGATE_PG_DB gets its own database), stop removes everything.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "postgres-local.sh"
IS_ROOT = os.geteuid() == 0


def installed() -> bool:
    return bool(glob.glob("/usr/lib/postgresql/*/bin/initdb"))


def script(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,  # the first start as root may apt-get install postgresql
        check=False,
    )


@pytest.fixture
def pg_dir() -> Iterator[Path]:
    """A cluster directory the `postgres` user can reach (as root the cluster runs as it), not
    yet created; whatever the test leaves running is stopped."""
    if not IS_ROOT and not installed():
        pytest.skip("PostgreSQL is not installed and only root may apt-get install it")
    parent = Path(tempfile.mkdtemp(prefix="slurmgate-pgtest-", dir="/tmp" if IS_ROOT else None))
    parent.chmod(0o755)
    directory = parent / "pg"
    try:
        yield directory
    finally:
        script("stop", SLURMGATE_PG_DIR=str(directory))
        shutil.rmtree(parent, ignore_errors=True)


async def current_database(url: str) -> str:
    import asyncpg

    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        name: str = await connection.fetchval("SELECT current_database()")
        return name
    finally:
        await connection.close()


def test_start_is_idempotent_and_stop_removes_the_cluster(pg_dir: Path) -> None:
    first = script("start", SLURMGATE_PG_DIR=str(pg_dir))
    assert first.returncode == 0, first.stderr
    url = first.stdout.strip().splitlines()[-1]
    assert url.startswith("postgresql+asyncpg://postgres@127.0.0.1:") and url.endswith("/prefect")
    assert asyncio.run(current_database(url)) == "prefect"

    again = script("start", SLURMGATE_PG_DIR=str(pg_dir))
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == url
    other = script("start", SLURMGATE_PG_DIR=str(pg_dir), SLURMGATE_PG_DB="prefect_other")
    assert other.returncode == 0, other.stderr
    other_url = other.stdout.strip().splitlines()[-1]
    assert other_url == url.removesuffix("/prefect") + "/prefect_other"
    assert asyncio.run(current_database(other_url)) == "prefect_other"
    status = script("status", SLURMGATE_PG_DIR=str(pg_dir))
    assert status.returncode == 0 and url in status.stdout

    for _ in range(2):  # stop on a stopped cluster is a no-op
        stopped = script("stop", SLURMGATE_PG_DIR=str(pg_dir))
        assert stopped.returncode == 0, stopped.stderr
    assert not pg_dir.exists()
    assert script("status", SLURMGATE_PG_DIR=str(pg_dir)).returncode == 3
    with pytest.raises(OSError):
        asyncio.run(current_database(url))


def test_a_bad_database_name_is_refused_naming_the_setting(tmp_path: Path) -> None:
    done = script("start", SLURMGATE_PG_DIR=str(tmp_path / "pg"), SLURMGATE_PG_DB="x'; DROP")
    assert done.returncode == 1
    assert "SLURMGATE_PG_DB" in done.stderr and "letters, digits and _" in done.stderr
    assert not (tmp_path / "pg").exists()


def test_usage_names_the_commands() -> None:
    done = script("restart")
    assert done.returncode == 1 and "start|stop|url|status" in done.stderr


@pytest.mark.skipif(not IS_ROOT, reason="only root runs the cluster as the postgres user")
def test_a_directory_the_postgres_user_cannot_reach_is_refused(tmp_path: Path) -> None:
    if not installed():
        pytest.skip("PostgreSQL is not installed")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    done = script("start", SLURMGATE_PG_DIR=str(private / "pg"))
    assert done.returncode == 1
    assert "cannot reach" in done.stderr and "SLURMGATE_PG_DIR" in done.stderr
    assert not (private / "pg").exists()
