"""A stand-in for TensorRT-LLM's `trtllm-llmapi-launch`: the MPI world forms, rank 0 serves.

`trtllm-llmapi-launch CMD…` runs CMD on rank 0 and TensorRT-LLM's worker loop on the other
ranks, which then follow rank 0 until the step ends. Here every rank joins the world through
mpi4py (Slurm's pmix plugin hands it the world), every rank reports its rank, the world's size
and its node, rank 0 reports the whole world it gathered, then execs CMD (the stub server);
the other ranks wait, as TensorRT-LLM's workers wait on their leader.
"""

from __future__ import annotations

import os
import socket
import sys
import threading


def say(line: str) -> None:
    """One write per line: the ranks of a node share srun's output, split writes interleave."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m slurmgate.testbed.mpi_launch CMD [ARGS…]", file=sys.stderr)
        return 64
    from mpi4py import MPI  # imported late: Open MPI's init reads the environment Slurm set

    world = MPI.COMM_WORLD
    rank, size, host = world.Get_rank(), world.Get_size(), socket.gethostname()
    # a collective: proof the ranks talk to each other, not only that each one started
    everyone = world.allgather((rank, host))
    say(f"mpi-launch: rank {rank} of {size} on {host}")
    if rank == 0:
        say(f"mpi-launch: world of {size}: {' '.join(f'{r}@{h}' for r, h in everyone)}")
        os.execvp(argv[0], argv)
    threading.Event().wait()  # until the step stops this rank
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
