"""The `slurmgate` command: one typer app, every command group registered the same way."""

from __future__ import annotations

import contextlib

import click
import typer

from slurmgate.cli import (
    admission,
    allocation,
    bench,
    ci,
    cluster,
    cordon,
    demo,
    deploy,
    endpoint,
    init,
    loadgen,
    results,
    simulate,
    spec,
    testbed,
    webhook,
)

app = typer.Typer(
    name="slurmgate",
    help="Admit multi-node GPU jobs from GitHub Actions onto Slurm, and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """slurmgate: weighted runner leases for GitHub Actions on Slurm, run by Prefect."""


# Each module holds one command group as a typer app: flat groups merge into the root, the
# others keep their name as a sub-command.
_FLAT = (init, deploy, admission, cordon, ci, webhook, testbed, loadgen, simulate, endpoint, demo)
for _flat in _FLAT:
    app.add_typer(_flat.app)
app.add_typer(cluster.app, name="cluster")
app.add_typer(allocation.app, name="allocation")
app.add_typer(spec.app, name="spec")
app.add_typer(bench.app, name="bench")
app.add_typer(results.app, name="results")


def _exceptions(name: str) -> tuple[type[BaseException], ...]:
    """click's exception class `name`, and typer's vendored copy of it when typer has one."""
    found: list[type[BaseException]] = [getattr(click.exceptions, name)]
    with contextlib.suppress(ImportError, AttributeError):
        import typer._click.exceptions as vendored

        found.append(getattr(vendored, name))
    if name in ("Exit", "Abort"):
        found.append(getattr(typer, name))
    return tuple(found)


_USAGE = _exceptions("UsageError")
_EXIT = _exceptions("Exit")
_ABORT = _exceptions("Abort")


def run(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code. Usage errors are one line on stderr and code 2."""
    try:
        code = app(args=argv, standalone_mode=False)
    except _USAGE as exc:
        formatter = getattr(exc, "format_message", None)
        message = formatter() if callable(formatter) else str(exc)
        if type(exc).__name__ == "NoArgsIsHelpError":
            typer.echo(message, err=True)
        else:
            typer.echo(f"error: {' '.join(str(message).split())}", err=True)
        return 2
    except _ABORT:
        return 130
    except _EXIT as exc:
        return int(getattr(exc, "exit_code", 0) or 0)
    except SystemExit as exc:  # an argparse-based command (endpoint) exits on its own
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> None:
    """The console-script entry point."""
    raise SystemExit(run(argv))
