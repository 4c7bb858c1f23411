"""The Slurm adapter: its real commands, its configuration, capacity per pool and cluster."""
