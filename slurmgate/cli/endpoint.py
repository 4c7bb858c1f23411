"""`slurmgate endpoint`: serve one deployment's logical endpoint, with the endpoint's own flags."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command(
    "endpoint",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def endpoint(ctx: typer.Context) -> None:
    """Route, retry and stream to a deployment's lane heads (--help lists every flag)."""
    from slurmgate.runtime.endpoint.app import main

    # One parser: the flags are those of `python -m slurmgate.runtime.endpoint`, which the
    # allocation runtime starts on the client host.
    main(list(ctx.args), prog="slurmgate endpoint")
