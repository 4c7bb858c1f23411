"""`slurmgate labels` and `node-count`: what a GitHub workflow runs to ask for capacity."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from slurmgate.ci.priority import (
    DEFAULT_POLICY,
    PriorityPolicyError,
    criteria_from_classifier,
    load_priority_policy,
)
from slurmgate.ci.runs_on import (
    CIError,
    JobSpec,
    LabelFlags,
    RunContext,
    compute_labels,
    flags_from_env,
    github_output_lines,
    load_hardware,
    load_spec,
    resolve_node_count,
    skip_queue_pr,
)
from slurmgate.cli.common import fail
from slurmgate.settings.ci import CISettings

LABELS_EPILOG = (
    "Example: PRIORITY_SCHEDULER_ENABLED=true NODE_SLOT_SCHEDULER_ENABLED=true "
    "slurmgate labels row.json --run-id 42 --run-attempt 1 --github-output  "
    "(prints {'runs-on': [...], 'nodes': 3, ...}; a workflow reads runs-on with fromJSON). "
    "A row without node-count whose count cannot be derived (a historical row) gets no nodes: "
    "label, as the seed's guard does; --skip-queue-pr 123 adds ci-skip-queue-pr-123."
)
NODE_COUNT_EPILOG = (
    "Example: slurmgate node-count examples/specs/local-stub.yaml  "
    "(an allocation spec: a mapping with `deployments`; an srt-slurm recipe: `resources`, or "
    "FILE.yaml:selector for one variant of a file with `base`; else one matrix row)"
)

app = typer.Typer()


def _read(spec: str, hardware: Path | None, recipes: Path | None) -> JobSpec:
    """The spec or row (`-`: standard input); bad input is a one-line error, exit code 2."""
    try:
        table = load_hardware(hardware) if hardware is not None else None
        if spec == "-":
            return load_spec("<stdin>", sys.stdin.read(), table, recipes)
        return load_spec(spec, None, table, recipes)
    except CIError as exc:
        raise fail(str(exc)) from None


SpecArg = Annotated[
    str,
    typer.Argument(
        help="An allocation spec, an srt-slurm recipe (FILE.yaml:selector for one variant) or "
        "one matrix row, as YAML or JSON; - reads standard input.",
        show_default=False,
    ),
]
HardwareOpt = Annotated[
    Path | None,
    typer.Option(help="GPUs per node by runner label (YAML mapping, or runners.yaml)."),
]
RecipesOpt = Annotated[
    Path | None,
    typer.Option(help="Folder that CONFIG_FILE=recipes/... paths are relative to."),
]


@app.command("labels", epilog=LABELS_EPILOG)
def labels(
    spec: SpecArg,
    runner: Annotated[
        str | None,
        typer.Option(help="Pool or runner label (default: the row's `runner`)."),
    ] = None,
    run_id: Annotated[
        int | None, typer.Option(envvar="GITHUB_RUN_ID", help="Workflow run id.")
    ] = None,
    run_attempt: Annotated[
        int | None, typer.Option(envvar="GITHUB_RUN_ATTEMPT", help="Workflow run attempt.")
    ] = None,
    event: Annotated[
        str, typer.Option(envvar="GITHUB_EVENT_NAME", help="Triggering event (push scores +2).")
    ] = "",
    pr_label: Annotated[
        list[str] | None, typer.Option(help="A pull-request label; repeat for more.")
    ] = None,
    criteria: Annotated[
        str | None,
        typer.Option(help="The classifier's answer as JSON; unusable answers fail closed."),
    ] = None,
    family: Annotated[str | None, typer.Option(help="Queue-token namespace suffix.")] = None,
    matrix_path: Annotated[
        str, typer.Option(help="The row's path in the matrix, e.g. config/3 (token input).")
    ] = "",
    skip_queue: Annotated[
        str,
        typer.Option(
            "--skip-queue-pr",
            envvar="SLURMGATE_SKIP_QUEUE_PR",
            help="PR number whose skip_queue label lets this job skip the queue (adds "
            "ci-skip-queue-pr-<PR> when priority is on); empty: none. The row's "
            "skip-queue-pr does the same.",
            show_default=False,
        ),
    ] = "",
    priority: Annotated[
        bool | None,
        typer.Option(
            "--priority/--no-priority",
            help="Override PRIORITY_SCHEDULER_ENABLED.",
            show_default=False,
        ),
    ] = None,
    node_slots: Annotated[
        bool | None,
        typer.Option(
            "--node-slots/--no-node-slots",
            help="Override NODE_SLOT_SCHEDULER_ENABLED.",
            show_default=False,
        ),
    ] = None,
    github_output: Annotated[
        bool,
        typer.Option(help="Also append the outputs to the file named by $GITHUB_OUTPUT."),
    ] = False,
    hardware: HardwareOpt = None,
    recipes: RecipesOpt = None,
    priority_policy: Annotated[
        Path | None,
        typer.Option(
            envvar="SLURMGATE_PRIORITY_POLICY",
            help="The priority weights from a policy file in InferenceX's "
            "configs/ci-priority.yaml format (version 1); default: the seed's weights.",
        ),
    ] = None,
) -> None:
    """Print a job's runs-on labels as JSON (self-hosted, pool, nodes:N, ci-job-*, ci-attempt-*)."""
    job = _read(spec, hardware, recipes)
    try:
        weights = load_priority_policy(priority_policy) if priority_policy else DEFAULT_POLICY
    except PriorityPolicyError as exc:
        raise fail(str(exc)) from None
    try:
        flags = flags_from_env(CISettings.environ())
        for note in flags.notes:
            typer.echo(f"note: {note}", err=True)
        if priority is not None or node_slots is not None:
            flags = LabelFlags(
                priority=flags.priority if priority is None else priority,
                node_slots=flags.node_slots if node_slots is None else node_slots,
            )
        context = RunContext(
            run_id=run_id,
            run_attempt=run_attempt,
            event=event,
            pr_labels=frozenset(pr_label or ()),
            criteria=criteria_from_classifier(criteria) if criteria is not None else None,
            family=family or None,
            matrix_path=tuple(part for part in matrix_path.split("/") if part),
            skip_queue_pr=skip_queue_pr(skip_queue, "--skip-queue-pr"),
        )
        result = compute_labels(job, flags, context, runner, weights)
    except CIError as exc:
        raise fail(str(exc)) from None
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)
    if github_output:
        target = (CISettings.text("github_output") or "").strip()
        if not target:
            raise fail("--github-output needs $GITHUB_OUTPUT; it is set inside GitHub Actions")
        with open(target, "a", encoding="utf-8") as handle:
            handle.write(github_output_lines(result.outputs()))
    typer.echo(json.dumps(result.as_dict(), separators=(",", ":")))


@app.command("node-count", epilog=NODE_COUNT_EPILOG)
def node_count(
    spec: SpecArg,
    hardware: HardwareOpt = None,
    recipes: RecipesOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {kind, node-count} as JSON instead.")
    ] = False,
) -> None:
    """Print the Slurm node count of an allocation spec, a recipe or a row (empty when unknown)."""
    job = _read(spec, hardware, recipes)
    try:
        nodes = resolve_node_count(job).value
    except CIError as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps({"kind": job.kind, "node-count": nodes}))
        return
    if nodes is None:
        typer.echo("note: the row's node-count is empty (no nodes: label will be asked)", err=True)
    typer.echo("" if nodes is None else str(nodes))
