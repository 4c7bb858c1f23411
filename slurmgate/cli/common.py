"""What every command shares: a one-line error on stderr with its exit code, never a traceback."""

from __future__ import annotations

import typer


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: MESSAGE` on one line; return the Exit to raise (2: bad arguments)."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(code=code)
