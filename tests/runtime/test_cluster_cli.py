"""`slurmgate cluster up` on a running cluster is a no-op that prints SLURM_CONF."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmgate.slurm import commands as slurm
from slurmgate.testbed import cluster

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]

CLI = ["-m", "slurmgate.cli", "cluster"]


def test_scripts_ship_as_package_data_and_are_the_repository_copy() -> None:
    found = cluster.scripts_dir()
    assert found == Path(cluster.__file__).resolve().parent.parent / "data" / "slurm-local"
    assert found.resolve() == REPO / "scripts" / "slurm-local"  # one copy, no drift
    assert (found / "start.sh").is_file() and "shared" not in found.resolve().parts


def test_up_is_idempotent_and_prints_the_environment(slurm_cluster: dict[str, str]) -> None:
    if os.environ.get("SLURMGATE_LOCAL_SLURM") != "1" and os.geteuid() != 0:
        pytest.skip("only the suite that started the cluster may call up again")
    # A job running across the call proves the cluster was not restarted underneath it.
    job = slurm.salloc_no_shell(nodes=1, job_name="sg-test-up")
    try:
        out = subprocess.run(
            [sys.executable, *CLI, "up"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"export SLURM_CONF={slurm_cluster['SLURM_CONF']}"
        info = slurm.show_job(job)
        assert info is not None and info.state == "RUNNING"
    finally:
        slurm.scancel(job)
