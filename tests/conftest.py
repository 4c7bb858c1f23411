"""Suite-wide fixtures: an isolated Prefect home, the bundled Slurm cluster, the built wheel."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Each pytest-xdist worker inherits the main process's environment: it takes homes of its own.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def _own_dir(name: str, prefix: str) -> None:
    if _WORKER or name not in os.environ:
        os.environ[name] = path = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, path, ignore_errors=True)  # the session's, not the user's


# Prefect reads its settings at import time: isolate it before any test module imports it.
_own_dir("PREFECT_HOME", "slurmgate-prefect-")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# Prefect's temporary server takes ~20 s to start on 2 busy cores, its default limit; the
# commands under test raise it the same way (slurmgate/cli/prefect_layer.py).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
# A migrated Prefect database, built once per Prefect version in the user's cache: each empty
# Prefect home a test's temporary server starts in gets a copy instead of ~10 s of migrations.
if "SLURMGATE_PREFECT_DB_TEMPLATE" not in os.environ:
    from slurmgate.testbed.prefect_server import migrated_database

    os.environ["SLURMGATE_PREFECT_DB_TEMPLATE"] = str(
        migrated_database(Path.home() / ".cache" / "slurmgate")
    )
# Allocation run records, which every reconcile tick scans for crashed runs to reap: the suite
# keeps its own, so a record left in the user's ~/.cache never reaches a test tick (or v.v.).
_own_dir("SLURMGATE_RUNS_DIR", "slurmgate-runs-")
# What node workers keep of their lanes' logs and results until a run collects them: the suite's
# own folder, so a test's worker that is never collected leaves nothing in the node's /tmp.
_own_dir("SLURMGATE_NODE_OUTPUTS_ROOT", "slurmgate-node-outputs-")


def slurm_unavailable_reason() -> str | None:
    """Why the real Slurm tests cannot run here, or None when the cluster answers."""
    forced = os.environ.get("SLURMGATE_SLURM_UNAVAILABLE")
    if forced:
        return forced
    if not os.environ.get("SLURM_CONF"):
        return (
            "SLURM_CONF is not set: run the suite through `make test`, "
            "which starts the bundled cluster"
        )
    if shutil.which("sinfo") is None:
        return "sinfo is not installed (Debian package slurm-client)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10, check=False
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 10 s"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """The bundled local Slurm cluster (started by scripts/test.sh); skips with the reason."""
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(f"real Slurm unavailable: {reason}")
    yield {"SLURM_CONF": os.environ["SLURM_CONF"]}


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One Prefect test server for the session (about 10 s to start, a minute and more on a
    loaded machine), shared by flow tests."""
    import prefect.testing.utilities as harness

    from slurmgate.prefect_db import seed_prefect_database

    # The harness puts its database in a fresh mkdtemp(): that folder gets the migrated copy.
    fresh = harness.mkdtemp

    def seeded() -> str:
        folder = fresh()
        seed_prefect_database(Path(folder), "prefect-test.db")
        return folder

    harness.mkdtemp = seeded
    try:
        with harness.prefect_test_harness(server_startup_timeout=120):
            yield
    finally:
        harness.mkdtemp = fresh


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the bundled cluster is marked `slurm`, so `-m` selects it. The test
    command runs the `slurm` tests one at a time in one pytest process (they share the cluster's
    four nodes and fixed ports); beside it, the `serial` tests (a wall-clock window) one at a
    time, then the rest on two xdist workers."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel built from this checkout; its bin directory.

    The wheel goes in without dependencies, which come from the test's own environment through
    a path file (site-packages only: the checkout's editable finder is not loaded there; of
    their console scripts only `prefect` is put in this bin, as a shim), so it costs seconds;
    pyproject's dependency list is checked against the imports in tests/architecture.
    """
    import sysconfig

    root = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), "."],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("slurmgate-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", purelib],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "zz-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the console script a full install of the dependencies would have put here
    shim = venv / "bin" / "prefect"
    shim.write_text(f'#!/bin/sh\nexec "{venv / "bin" / "python"}" -m prefect "$@"\n')
    shim.chmod(0o755)
    return venv / "bin"
