"""The `slurmgate` command line: one typer app (`app.py`), one module per command group."""
