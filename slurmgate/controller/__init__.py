"""The controller wiring: the reconcile tick's steps over the GitHub and Slurm adapters."""
