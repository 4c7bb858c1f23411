"""slurmgate: weighted runner-lease admission and the Slurm allocation runtime (core)."""

__version__ = "0.1.0"
