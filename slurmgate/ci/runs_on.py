"""The CI side of admission: a job's runs-on label set from its spec or matrix row.

A job is described by one of three documents, told apart by shape:

- an **allocation spec** (`slurmgate.runtime.spec`): a mapping with a `deployments` key; its
  node count is the allocation's `total_nodes`, and it names no runner, so the caller passes one;
- an **srt-slurm recipe** (a `resources:` section, srt-slurm 2.x's `schema:`, or one variant of
  a file with a `base:` section, named `FILE.yaml:selector`): its node count is the recipe's,
  as InferenceX counts it, and it names no runner either;
- a **matrix row** (the seed's generated config): any other mapping; its node count is its
  `node-count` field when the field is present (an empty value means "unknown": the guard
  applies), else it is derived by `slurmgate.ci.nodecount` (a single-node row counts 1).

The label set follows the seed's table (docs/seed.md): with the priority flag off only
`[<runner>]` (legacy); with it on `self-hosted, <runner>, [nodes:N,] ci-job-<score>-<token>,
ci-attempt-<n>[, ci-skip-queue-pr-<PR>]`, where `nodes:N` appears only when the node-slot flag
is on and the node count is known.

A node count is derived only when the priority flag is on (the score's node term and, with the
node-slot flag, `nodes:N` use it). A **historical row** (written before node counts existed:
no `node-count` field) whose count needs GPUs per node that the hardware table does not know
(`nodecount.UnknownGpusPerNode`) gets no count, like the seed's empty `node-count`: it is
scored as one node and asks for no `nodes:` label. Any claim the row makes (`node-count`,
`num-nodes`, `PREFILL_NODES`/`DECODE_NODES`, a recipe, a role's shape) that is invalid stays
an error naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slurmgate.admission.labels import (
    MAX_PR_NUMBER,
    SKIP_QUEUE_PREFIX,
    attempt_label,
    fold,
    nodes_label,
)
from slurmgate.ci.nodecount import (
    NodeCountError,
    UnknownGpusPerNode,
    is_recipe,
    node_count,
    recipe_node_count,
)
from slurmgate.ci.priority import (
    DEFAULT_POLICY,
    PriorityContext,
    PriorityPolicy,
    job_label,
    queue_namespace,
    queue_token,
    render_score,
    score,
)
from slurmgate.documents import DocumentError, parse_yaml, read_yaml
from slurmgate.errors import InputError
from slurmgate.runtime.spec import variants
from slurmgate.runtime.spec.recipes import RecipeError
from slurmgate.settings.admission import flag_value

PRIORITY_FLAG = "PRIORITY_SCHEDULER_ENABLED"
NODE_SLOT_FLAG = "NODE_SLOT_SCHEDULER_ENABLED"
SELF_HOSTED = "self-hosted"
SKIP_QUEUE_KEY = "skip-queue-pr"

SpecKind = Literal["allocation", "recipe", "row"]
# Keys of InferenceX's matrix rows; a document with none of them (and neither a spec nor a
# recipe) is not a row: counting it as one node would over-admit whatever it describes.
ROW_KEYS = frozenset(
    {"runner", "multinode", "disagg", "num-nodes", "prefill", "decode", "node-count", "framework"}
    | {"image", "exp-name", "conc", "conc-list", "precision", "isl", "osl", "model-prefix"}
)
Mode = Literal["legacy", "priority", "node-slots"]

# The keys `LabelSet.outputs()` writes; the example workflow may reference only these.
OUTPUT_KEYS = ("runs-on", "nodes", "score", "token", "job-label", "attempt-label", "mode")


class CIError(InputError):
    """Bad CI input, worded as `field: problem; fix` on one line."""


@dataclass(frozen=True, slots=True)
class LabelFlags:
    """The seed's two feature flags as the workflow sees them; `notes` say why a value that
    is set reads as off."""

    priority: bool = False
    node_slots: bool = False
    notes: tuple[str, ...] = ()


def flags_from_env(env: Mapping[str, str]) -> LabelFlags:
    """Read both flags as the seed's workflow templates test them (`vars.FLAG == 'true'`,
    which GitHub compares ignoring case): on only when the value is `true` in any case; unset,
    empty, `false` or anything else (`1`, `yes`) is off, the last with a note, because the
    templates' own jobs would take it as off too. Unlike the planner's settings, node slots on
    with priority off is not an error here: the seed's table makes that the legacy label set."""
    values: dict[str, bool] = {}
    notes: list[str] = []
    for name in (PRIORITY_FLAG, NODE_SLOT_FLAG):
        raw = env.get(name, "")
        values[name], note = flag_value(name, raw)
        if note:
            notes.append(note)
    return LabelFlags(values[PRIORITY_FLAG], values[NODE_SLOT_FLAG], tuple(notes))


@dataclass(frozen=True, slots=True)
class RunContext:
    """The workflow run a job belongs to: it namespaces the queue token and sets the attempt."""

    run_id: int | None = None
    run_attempt: int | None = None
    event: str = ""
    pr_labels: frozenset[str] = frozenset()
    criteria: frozenset[str] | None = None
    family: str | None = None
    matrix_path: tuple[str, ...] = ()
    skip_queue_pr: int | None = None


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A loaded job description: its kind, its data, the node count it states, and the facts
    (GPUs per node, recipes) its node count is derived from when it states none.

    `nodes` is the allocation's total or the row's `node-count` (None: empty or absent);
    `resolve_node_count` derives the rest only when a caller needs it.
    """

    kind: SpecKind
    data: Mapping[str, Any]
    nodes: int | None
    runner: str | None
    source: str = "spec"
    hardware: Mapping[str, int] | None = None
    recipe_root: Path | None = None
    skip_queue_pr: int | None = None

    @property
    def states_node_count(self) -> bool:
        """An allocation spec and a recipe always do; a row does when it has `node-count`."""
        return self.kind in ("allocation", "recipe") or "node-count" in self.data


@dataclass(frozen=True, slots=True)
class NodeCount:
    """A job's node count as admission uses it: a number, or None with the reason."""

    value: int | None
    note: str | None = None


@dataclass(frozen=True, slots=True)
class LabelSet:
    """The runs-on labels of one job and the parts they were made from."""

    runs_on: tuple[str, ...]
    mode: Mode
    runner: str
    nodes: int | None = None
    score: str | None = None
    token: str | None = None
    job_label: str | None = None
    attempt_label: str | None = None
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        """The JSON document `slurmgate labels` prints (keys as in OUTPUT_KEYS)."""
        return {
            "runs-on": list(self.runs_on),
            "nodes": self.nodes,
            "score": self.score,
            "token": self.token,
            "job-label": self.job_label,
            "attempt-label": self.attempt_label,
            "mode": self.mode,
        }

    def outputs(self) -> dict[str, str]:
        """`$GITHUB_OUTPUT` lines: runs-on as compact JSON for fromJSON, the rest as text."""
        out: dict[str, str] = {}
        for key, value in self.as_dict().items():
            if isinstance(value, list):
                out[key] = json.dumps(value, separators=(",", ":"))
            else:
                out[key] = "" if value is None else str(value)
        return out


def _from_digits(value: object) -> object:
    """A string of ASCII digits as its int; anything else unchanged, for the caller to reject.

    Only ASCII: `str.isdigit` also accepts superscripts and other scripts' digits, which `int`
    then refuses or reads as a number nobody wrote.
    """
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value.strip())
    return value


def _positive(value: object, where: str, fix: str) -> int:
    value = _from_digits(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CIError(f"{where} must be a positive integer, got {value!r}; {fix}")
    return value


def is_allocation_spec(data: Mapping[str, Any]) -> bool:
    """An allocation spec has `deployments`; everything else is a matrix row."""
    return "deployments" in data


def stated_node_count(row: Mapping[str, Any]) -> int | None:
    """A matrix row's `node-count` field: None when empty or absent, else a positive integer."""
    raw = row.get("node-count")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    return _positive(raw, "node-count", "write the row's Slurm node count, or leave it empty")


def skip_queue_pr(value: object, where: str) -> int | None:
    """A skip-queue PR number: None when empty or absent, else 1..MAX_PR_NUMBER."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    value = _from_digits(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PR_NUMBER:
        raise CIError(
            f"{where} must be a pull-request number from 1 to {MAX_PR_NUMBER}, got {value!r}; "
            "pass the PR's number, or leave it empty when the PR does not skip the queue"
        )
    return value


def resolve_node_count(spec: JobSpec, historical_fallback: bool = False) -> NodeCount:
    """The job's node count: the one it states, else derived from its row.

    With `historical_fallback`, a row without a `node-count` field whose GPUs per node are
    unknown gets None and a note (the seed's legacy one-node accounting) instead of an error.
    """
    if spec.states_node_count:
        note = None if spec.nodes is not None else "the row's node-count is empty"
        return NodeCount(spec.nodes, note)
    try:
        return NodeCount(node_count(spec.data, spec.hardware or {}, spec.recipe_root))
    except UnknownGpusPerNode as exc:
        if not historical_fallback:
            raise CIError(f"{exc}") from None
        return NodeCount(
            None,
            f"historical row without node-count whose count cannot be derived ({exc}); "
            "it is scored and admitted as one node. Add node-count to the row, or pass "
            "--hardware with its runner label, to size it",
        )
    except NodeCountError as exc:
        raise CIError(f"{exc}") from None


def spec_from_data(
    data: object,
    source: str = "spec",
    hardware: Mapping[str, int] | None = None,
    recipe_root: Path | None = None,
) -> JobSpec:
    """Classify and validate a decoded document; the node count is resolved here."""
    if not isinstance(data, Mapping):
        raise CIError(
            f"{source}: expected a mapping (an allocation spec or one matrix row), "
            f"got {type(data).__name__}; pass a single row, not the whole matrix"
        )
    if is_allocation_spec(data):
        from slurmgate.runtime.spec.allocation import AllocationSpec
        from slurmgate.runtime.spec.errors import SpecError

        try:
            spec = AllocationSpec.from_data(dict(data), source=source)
        except SpecError as exc:
            raise CIError(f"{source}: " + "; ".join(str(exc).splitlines())) from None
        return JobSpec("allocation", data, spec.total_nodes, None, source)
    if (is_recipe(data) or variants.has_variants(data)) and "runner" not in data:
        try:
            recipe_nodes = recipe_node_count(data, source)
        except NodeCountError as exc:
            raise CIError(str(exc)) from None
        return JobSpec("recipe", data, recipe_nodes, None, source)
    if not ROW_KEYS & set(map(str, data)):
        raise CIError(
            f"{source}: neither an allocation spec (schema_version, deployments), an srt-slurm "
            "recipe (resources) nor a matrix row (runner, prefill/decode, num-nodes, …); "
            "pass one of them"
        )
    runner = data.get("runner")
    if runner is not None and (not isinstance(runner, str) or not runner.strip()):
        raise CIError(f"{source}: runner must be a runner label like cluster:h100, got {runner!r}")
    try:
        nodes = stated_node_count(data)
        pr = skip_queue_pr(data.get(SKIP_QUEUE_KEY), SKIP_QUEUE_KEY)
    except CIError as exc:
        raise CIError(f"{source}: {exc}") from None
    return JobSpec(
        "row",
        data,
        nodes,
        runner.strip() if runner else None,
        source,
        hardware=hardware,
        recipe_root=recipe_root,
        skip_queue_pr=pr,
    )


def load_spec(
    path: str | Path,
    text: str | None = None,
    hardware: Mapping[str, int] | None = None,
    recipe_root: Path | None = None,
) -> JobSpec:
    """Read a YAML or JSON document (JSON is YAML) from `path`, or from `text` when given;
    `FILE.yaml:selector` names one variant of an srt-slurm recipe with a `base:` section."""
    source = str(path)
    try:
        if text is not None:
            data = parse_yaml(text, source, kind="YAML or JSON")
        else:
            file, selector = variants.split(path)
            data = read_yaml(file, kind="YAML or JSON")
            if selector is not None:
                if not isinstance(data, dict):
                    raise CIError(f"{source}: a selector names a recipe variant; {file} is none")
                data = variants.select(data, selector, str(file))
    except DocumentError as exc:
        raise CIError(str(exc)) from None
    except RecipeError as exc:
        raise CIError(str(exc)) from None
    return spec_from_data(data, source, hardware, recipe_root)


def load_hardware(path: str | Path) -> dict[str, int]:
    """A GPUs-per-node table: `{label: gpus}`, or a runners.yaml with a `hardware:` section."""
    try:
        data = read_yaml(path)
    except DocumentError as exc:
        raise CIError(f"--hardware {exc}") from None
    if isinstance(data, Mapping) and isinstance(data.get("hardware"), Mapping):
        data = data["hardware"]
    if not isinstance(data, Mapping):
        raise CIError(f"--hardware {path}: expected a mapping of runner label to GPUs per node")
    table: dict[str, int] = {}
    for label, value in data.items():
        if isinstance(value, Mapping):
            value = value.get("gpus-per-node", value.get("gpus_per_node"))
        table[str(label)] = _positive(value, f"hardware[{label!r}]", "give GPUs per node")
    return table


def _score_row(spec: JobSpec, nodes: int | None) -> dict[str, Any]:
    """The row the priority formula sees: the matrix row (or nothing, for an allocation spec)
    with its resolved node count, so an empty `node-count` does not fail the formula."""
    row = dict(spec.data) if spec.kind == "row" else {}
    row.pop("node-count", None)
    if nodes is not None:
        row["node-count"] = nodes
    return row


def _skip_queue(spec: JobSpec, context: RunContext) -> int | None:
    """The PR number from the row or the workflow input; both may name it, but not differently."""
    row, given = spec.skip_queue_pr, context.skip_queue_pr
    if row is not None and given is not None and row != given:
        raise CIError(
            f"{spec.source}: {SKIP_QUEUE_KEY} is {row} but --skip-queue-pr is {given}; "
            "pass the row's PR number or leave the option empty"
        )
    return row if row is not None else given


def compute_labels(
    spec: JobSpec,
    flags: LabelFlags,
    context: RunContext,
    runner: str | None = None,
    policy: PriorityPolicy = DEFAULT_POLICY,
) -> LabelSet:
    """The job's runs-on label set under the seed's table, with its guard on `nodes:`."""
    label = (runner or spec.runner or "").strip()
    if not label:
        where = "--runner" if spec.kind != "row" else f"{spec.source}: runner"
        raise CIError(
            f"{where} is missing; an allocation spec or a recipe names no runner, pass "
            "--runner cluster:NAME"
            if spec.kind != "row"
            else f"{where} is missing; add runner: cluster:NAME to the row or pass --runner"
        )
    skip_queue = _skip_queue(spec, context)
    if not flags.priority:
        # the seed's legacy set ignores the node count, so none is derived: no row can fail here
        return LabelSet(runs_on=(label,), mode="legacy", runner=label, nodes=spec.nodes)
    if context.run_id is None or context.run_attempt is None:
        missing = "--run-id" if context.run_id is None else "--run-attempt"
        raise CIError(
            f"{missing} is missing; pass it or run inside GitHub Actions "
            "(GITHUB_RUN_ID / GITHUB_RUN_ATTEMPT)"
        )
    run_id = _positive(context.run_id, "--run-id", "pass the workflow run id")
    attempt = _positive(context.run_attempt, "--run-attempt", "pass the run attempt (1 or more)")
    nodes = resolve_node_count(spec, historical_fallback=True)
    try:
        value = score(
            _score_row(spec, nodes.value),
            PriorityContext(context.event, context.pr_labels, context.criteria),
            policy,
        )
    except ValueError as exc:
        raise CIError(f"{spec.source}: {exc}") from None
    namespace = queue_namespace(run_id, attempt, context.family)
    token = queue_token(spec.data, namespace, context.matrix_path)
    gate = job_label(value, token)
    attempt_tag = attempt_label(attempt)
    notes: list[str] = []
    nodes_tag: list[str] = []
    mode: Mode = "priority"
    if flags.node_slots:
        mode = "node-slots"
        if nodes.value is None:
            notes.append(f"no nodes: label (the seed's guard): {nodes.note}")
        else:
            nodes_tag.append(nodes_label(nodes.value))
    skip_tag = [] if skip_queue is None else [f"{SKIP_QUEUE_PREFIX}{skip_queue}"]
    labels = _unique([SELF_HOSTED, label, *nodes_tag, gate, attempt_tag, *skip_tag])
    return LabelSet(
        runs_on=labels,
        mode=mode,
        runner=label,
        nodes=nodes.value,
        score=render_score(value),
        token=token,
        job_label=gate,
        attempt_label=attempt_tag,
        notes=tuple(notes),
    )


def _unique(labels: Sequence[str]) -> tuple[str, ...]:
    """Keep the first of labels that GitHub would treat as equal (case-insensitive)."""
    seen: set[str] = set()
    out: list[str] = []
    for label in labels:
        if fold(label) not in seen:
            seen.add(fold(label))
            out.append(label)
    return tuple(out)


def github_output_lines(outputs: Mapping[str, str]) -> str:
    """`key=value` lines for `$GITHUB_OUTPUT` (values here never contain newlines)."""
    return "".join(f"{key}={value}\n" for key, value in outputs.items())
