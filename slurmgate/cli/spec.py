"""`slurmgate spec check` and `from-recipe`: validate a spec file, or build one from a recipe."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from slurmgate.cli.common import fail

if TYPE_CHECKING:
    from slurmgate.runtime.spec.from_recipe import RecipeSpec

app = typer.Typer(
    help="Allocation specs: check one, or build one from an srt-slurm recipe.",
    no_args_is_help=True,
)

RecipeArg = Annotated[Path, typer.Argument(help="An srt-slurm recipe (schema 1 or 2, YAML).")]
ModelOpt = Annotated[
    str | None,
    typer.Option(help="The model path the workers load on this site (default /model)."),
]


def load_recipe_spec(recipe: Path, model: str | None) -> RecipeSpec:
    """The recipe's spec, or a one-line error (exit code 2) naming the key and the fix."""
    from slurmgate.runtime.spec.from_recipe import RecipeRefused, spec_from_recipe
    from slurmgate.runtime.spec.recipes import RecipeError

    try:
        return spec_from_recipe(recipe, model=model)
    except (RecipeError, RecipeRefused) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None


@app.command(
    "from-recipe",
    epilog="Example: slurmgate spec from-recipe RECIPE.yaml --model /shared/models/dsr1 > "
    "spec.yaml  (the keys run differently are reported on stderr and in the YAML's header)",
)
def from_recipe(recipe: RecipeArg, model: ModelOpt = None) -> None:
    """Print the allocation spec of an srt-slurm recipe as YAML."""
    built = load_recipe_spec(recipe, model)
    for r in built.reported:
        typer.echo(f"reported: {r.line()}", err=True)
    typer.echo(built.yaml(str(recipe)), nl=False)
    if not built.spec.deployments:
        raise fail("the recipe has no deployment")


@app.command(
    "check",
    epilog="Example: slurmgate spec check /site/specs/nightly.yaml  (every problem, by field)",
)
def check(spec: Annotated[Path, typer.Argument(help="An allocation spec (YAML).")]) -> None:
    """Validate an allocation spec file and print every problem, or what it would run."""
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.runtime.spec.errors import SpecError

    try:
        parsed = AllocationSpec.from_yaml(spec)
    except SpecError as exc:
        raise fail(str(exc)) from None
    nodes = parsed.total_nodes
    typer.echo(f"ok: {parsed.name}, {len(parsed.deployments)} deployment(s), {nodes} node(s)")
