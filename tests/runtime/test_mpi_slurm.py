"""An MPI world across the bundled cluster's nodes, launched the way TensorRT-LLM's are.

`srun --mpi=pmix`, a task per rank, Debian's Open MPI under Slurm's own pmix plugin, and mpi4py
from PyPI: every rank reports its rank, the world's size and its node. The pmix plugin makes a
directory per step in each node's TmpFS; the bundled nodes share one machine, so this passes
only because each node's slurmd sees its own TmpFS directory (scripts/slurm-local/start.sh).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

HELLO = """
import socket
from mpi4py import MPI
world = MPI.COMM_WORLD
# every rank's own answer, gathered at rank 0: proof the ranks talk, not only that they started
everyone = world.gather((world.Get_rank(), world.Get_size(), socket.gethostname()), root=0)
if world.Get_rank() == 0:
    for rank, size, host in everyone:
        print(f"rank {rank} of {size} on {host}", flush=True)
"""


def test_a_pmix_world_spans_two_nodes_and_every_rank_answers(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # ranks that wait give the 2 cores back
    ran = subprocess.run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=2",
            "--mpi=pmix",
            "--job-name=sg-test-mpi",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    lines = sorted(ran.stdout.split("\n")[:-1])
    ranks = [line.split() for line in lines]
    assert [int(r[1]) for r in ranks] == [0, 1, 2, 3], ran.stdout
    assert {r[3] for r in ranks} == {"4"}, ran.stdout
    hosts = [r[5] for r in ranks]
    # two ranks on each of two different nodes
    assert len(set(hosts)) == 2 and all(hosts.count(h) == 2 for h in hosts), ran.stdout
