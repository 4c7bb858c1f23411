"""`python -m slurmgate.cli`: the same command as the `slurmgate` console script."""

from slurmgate.cli.app import main

main()
