"""`slurmgate cordon` and `uncordon`: stop and restart new admissions to a pool (policy block).

A cordon lives in the saved `slurmgate-admission-policy` block's `cordoned_pools` (the block
the deployments load), so every controller that loads it sees it on its next tick and a
restart keeps it; nothing is written to a runner. A controller configured from its environment
reads `SLURMGATE_CORDONED_POOLS` instead.
"""

from __future__ import annotations

from typing import Annotated

import typer

from slurmgate.cli.common import fail

app = typer.Typer()

Pool = Annotated[str, typer.Argument(help="The pool: NAME or cluster:NAME.", show_default=False)]
BlockName = Annotated[
    str, typer.Option("--name", help="The policy block to edit (the deployments load default).")
]


def _edit(name: str, pool: str, reason: str | None) -> dict[str, str]:
    from slurmgate.cli import prefect_layer

    if prefect_layer.configured_prefect_api() is None:
        raise fail(
            "PREFECT_API_URL is not set, so there is no saved policy block to edit; point it at "
            "the server the deployments use (prefect config set PREFECT_API_URL=...), or set "
            "SLURMGATE_CORDONED_POOLS in the environment of a controller that reads it",
            code=1,
        )
    try:
        return prefect_layer.set_cordon(name, pool, reason)
    except ValueError as exc:
        raise fail(" ".join(str(exc).split())) from None


@app.command(
    "cordon",
    epilog='Example: slurmgate cordon h100 --reason "node swap until Friday"; undo: '
    "slurmgate uncordon h100",
)
def cordon(
    pool: Pool,
    reason: Annotated[
        str, typer.Option(help="Why, shown on the board and in every blocked job's reason.")
    ] = "cordoned",
    name: BlockName = "default",
) -> None:
    """Admit nothing new to a pool: its leases finish, the board says cordoned, then drained."""
    saved = _edit(name, pool, reason)
    typer.echo(f"cordoned {', '.join(f'{p} ({why})' for p, why in sorted(saved.items()))}")


@app.command("uncordon", epilog="Example: slurmgate uncordon h100")
def uncordon(pool: Pool, name: BlockName = "default") -> None:
    """Admit to a cordoned pool again, from the next tick."""
    saved = _edit(name, pool, None)
    still = ", ".join(sorted(saved)) or "none"
    typer.echo(f"uncordoned {pool}; cordoned pools now: {still}")
