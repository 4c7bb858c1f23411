"""The allocation runtime: what runs inside a Slurm allocation (never imports prefect)."""
