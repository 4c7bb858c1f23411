"""slurmgate: weighted runner-lease admission and the Slurm allocation runtime (the core, no prefect)."""

__version__ = "0.1.0"
