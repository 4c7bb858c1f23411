"""The seed's CI priority policy: score a matrix row, derive its queue token, render its job label.

A CI workflow calls `score()` and `queue_token()` for every matrix row and puts
`job_label(score, token)` into the job's runs-on; the planner reads the score back from that label.
The weights are the seed's (`DEFAULT_POLICY`), or those of a policy file in InferenceX's
`configs/ci-priority.yaml` format (`load_priority_policy`).
Higher scores run sooner. Every business term is a multiple of 0.25, while the node term is
-0.001 per node beyond the first, so node count only breaks ties between otherwise equal rows
(it would take 251 nodes to cross a 0.25 gap).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from slurmgate.admission.labels import JOB_PREFIX
from slurmgate.documents import DocumentError, parse_yaml, read_yaml
from slurmgate.errors import InputError

SCORE_QUANTUM = Decimal("0.001")
PATCHWORK = "patchwork"
FAIL_CLOSED: frozenset[str] = frozenset({PATCHWORK})
"""Criteria used when the classifier's answer is missing or malformed: everything is patchwork."""

_D = Decimal


class PriorityPolicy(BaseModel):
    """The weights of the seed formula (docs/seed.md, priority); defaults are the seed's values."""

    model_config = ConfigDict(frozen=True)

    base_score: Decimal = _D("1.0")
    event: dict[str, Decimal] = Field(default_factory=lambda: {"push": _D("2.0")})
    additional_node: Decimal = _D("-0.001")
    multi_node: Decimal = _D("1.25")
    agentic: Decimal = _D("1.0")
    eval_only: Decimal = _D("0.0")
    precision: dict[str, Decimal] = Field(default_factory=lambda: {"fp4": _D("0.75")})
    spec_decoding: dict[str, Decimal] = Field(
        default_factory=lambda: {"mtp": _D("0.75"), "eagle": _D("0.75"), "eagle3": _D("0.75")}
    )
    framework_prefix: dict[str, Decimal] = Field(
        default_factory=lambda: {
            "sglang": _D("0.5"),
            "vllm": _D("0.5"),
            "dynamo-sglang": _D("0.5"),
            "dynamo-vllm": _D("0.5"),
        }
    )
    model_prefix: dict[str, Decimal] = Field(
        default_factory=lambda: {
            "kimik3": _D("1.5"),
            **{
                name: _D("0.75")
                for name in ("glm5", "glm5.1", "kimik2.5", "dsv4", "minimaxm3", "qwen3.5", "dsr1")
            },
        }
    )
    checklist_labels: frozenset[str] = frozenset({"ci-checklist-complete"})
    checklist: Decimal = _D("0.25")
    patchwork_labels: frozenset[str] = frozenset({"ci-patchwork", "engine-patch"})
    waiver_labels: frozenset[str] = frozenset({"ci-patchwork-waived"})
    patchwork_score: Decimal = _D("0.000")

    def criteria(self) -> frozenset[str]:
        """Every classifier criterion this policy understands."""
        return frozenset(
            {"multi-node", "agentic", "eval-only", "checklist-complete", PATCHWORK}
            | set(self.precision)
            | set(self.spec_decoding)
            | set(self.framework_prefix)
            | set(self.model_prefix)
        )


DEFAULT_POLICY = PriorityPolicy()

POLICY_FILE_VERSION = 1
"""The only version of InferenceX's `configs/ci-priority.yaml` format its loader accepts."""


class PriorityPolicyError(InputError):
    """A priority policy file that cannot be used; the message names the file, field and fix."""


def _weight(value: object) -> Decimal:
    """A weight as InferenceX reads one, `Decimal(str(value))`: 1.25 is exactly 1.25."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"must be a number, got {value!r}")
    try:
        weight = Decimal(str(value))
    except ArithmeticError:
        raise ValueError(f"must be a number, got {value!r}") from None
    if not weight.is_finite():
        raise ValueError(f"must be a finite number, got {value!r}")
    return weight


Weight = Annotated[Decimal, BeforeValidator(_weight)]


class _FileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class _Adjustments(_FileModel):
    # InferenceX reads a missing adjustment as 0 (and a missing table as empty)
    additional_node: Weight = Field(default=Decimal(0), alias="additional-node")
    event: dict[str, Weight] = Field(default_factory=dict)
    multi_node: Weight = Field(default=Decimal(0), alias="multi-node")
    agentic: Weight = Decimal(0)
    eval_only: Weight = Field(default=Decimal(0), alias="eval-only")
    precision: dict[str, Weight] = Field(default_factory=dict)
    spec_decoding: dict[str, Weight] = Field(default_factory=dict, alias="spec-decoding")
    framework_prefix: dict[str, Weight] = Field(default_factory=dict, alias="framework-prefix")
    model_prefix: dict[str, Weight] = Field(default_factory=dict, alias="model-prefix")


class _SkipQueueLabel(_FileModel):
    name: str = Field(min_length=1)


class _ChecklistLabels(_FileModel):
    names: list[str] = Field(default_factory=list)
    adjustment: Weight = Decimal(0)


class _PatchworkLabels(_FileModel):
    names: list[str]
    score: Weight
    waived_by: list[str] = Field(default_factory=list, alias="waived-by")


class _Labels(_FileModel):
    # skip-queue's name is the controller's to read (AdmissionSettings.skip_queue_label)
    skip_queue: _SkipQueueLabel | None = Field(default=None, alias="skip-queue")
    checklist_complete: _ChecklistLabels = Field(
        default_factory=_ChecklistLabels, alias="checklist-complete"
    )
    patchwork: _PatchworkLabels


class PriorityPolicyFile(_FileModel):
    """InferenceX's `configs/ci-priority.yaml`, version 1, as its `utils/ci_priority.py` reads
    it; unknown keys are refused here (InferenceX ignores them), so a misspelt weight is an
    error rather than a silent 0."""

    version: int
    base_score: Weight = Field(alias="base-score")
    adjustments: _Adjustments
    labels: _Labels

    def policy(self) -> PriorityPolicy:
        a, labels = self.adjustments, self.labels
        return PriorityPolicy(
            base_score=self.base_score,
            event=a.event,
            additional_node=a.additional_node,
            multi_node=a.multi_node,
            agentic=a.agentic,
            eval_only=a.eval_only,
            precision=a.precision,
            spec_decoding=a.spec_decoding,
            framework_prefix=a.framework_prefix,
            model_prefix=a.model_prefix,
            checklist_labels=frozenset(labels.checklist_complete.names),
            checklist=labels.checklist_complete.adjustment,
            patchwork_labels=frozenset(labels.patchwork.names),
            waiver_labels=frozenset(labels.patchwork.waived_by),
            patchwork_score=labels.patchwork.score,
        )


def load_priority_policy(path: str | Path, text: str | None = None) -> PriorityPolicy:
    """The weights of a policy file in InferenceX's `configs/ci-priority.yaml` format.

    As InferenceX's `load_policy`, only `version: 1` is accepted; then every field is checked,
    and the message of a bad one names it. `text` is the file's content when already read.
    """
    where = str(path)
    try:
        data = read_yaml(path) if text is None else parse_yaml(text, str(where))
    except DocumentError as exc:
        raise PriorityPolicyError(f"priority policy {exc}") from None
    if not isinstance(data, Mapping):
        raise PriorityPolicyError(
            f"priority policy {where}: expected a mapping with version, base-score, "
            "adjustments and labels (InferenceX's configs/ci-priority.yaml format)"
        )
    version = data.get("version")
    if isinstance(version, bool) or version != POLICY_FILE_VERSION:
        raise PriorityPolicyError(
            f"priority policy {where}: unsupported version {version!r}; only version "
            f"{POLICY_FILE_VERSION} of the configs/ci-priority.yaml format is understood"
        )
    try:
        return PriorityPolicyFile.model_validate(data).policy()
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_input=False):
            field = ".".join(str(part) for part in error["loc"]) or "(top)"
            said = str(error["msg"]).removeprefix("Value error, ")
            problems.append(f"{field}: {said}")
        raise PriorityPolicyError(
            f"priority policy {where}: " + "; ".join(problems[:5]) + "; fix those fields"
        ) from None


@dataclass(frozen=True, slots=True)
class PriorityContext:
    """What the run adds to the row: its event, its PR labels, and the classifier's criteria.

    `criteria` None means no classifier ran (every fact of the row counts); a set means only the
    facts the classifier confirmed count.
    """

    event: str = ""
    labels: frozenset[str] = frozenset()
    criteria: frozenset[str] | None = None


def node_count_of(row: Mapping[str, Any]) -> int:
    """The row's `node-count` (1 when absent); anything but a positive integer is rejected."""
    value = row.get("node-count", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"node-count must be a positive integer, got {value!r}; "
            "set node-count to the row's Slurm node count (1 or more) or leave it out"
        )
    return value


def _prefix_match(value: str, prefixes: Collection[str]) -> str | None:
    for prefix in prefixes:
        if value == prefix or value.startswith(f"{prefix}-"):
            return prefix
    return None


def _project(
    row: Mapping[str, Any], criteria: frozenset[str], policy: PriorityPolicy
) -> dict[str, Any]:
    """Keep only the row facts the classifier confirmed; node-count passes through unchanged."""
    unknown = criteria - policy.criteria()
    if unknown:
        raise ValueError(
            f"unknown priority criteria {sorted(unknown)}; known criteria are "
            f"{sorted(policy.criteria())}"
        )
    precision = str(row.get("precision", ""))
    spec = str(row.get("spec-decoding", ""))
    framework = str(row.get("framework", ""))
    model = str(row.get("model-prefix", ""))
    framework_hit = _prefix_match(framework, policy.framework_prefix)
    projected: dict[str, Any] = {
        "prefill": {} if "multi-node" in criteria and row.get("prefill") is not None else None,
        "scenario-type": (
            "agentic-coding"
            if "agentic" in criteria and row.get("scenario-type") == "agentic-coding"
            else ""
        ),
        "eval-only": "eval-only" in criteria and row.get("eval-only") is True,
        "precision": precision if precision in criteria else "",
        "spec-decoding": spec if spec in criteria else "",
        "framework": framework if framework_hit is not None and framework_hit in criteria else "",
        "model-prefix": model if model in criteria else "",
    }
    if "node-count" in row:
        projected["node-count"] = row["node-count"]
    return projected


def score(
    row: Mapping[str, Any],
    context: PriorityContext = PriorityContext(),
    policy: PriorityPolicy = DEFAULT_POLICY,
) -> Decimal:
    """The row's priority: higher runs sooner, quantized to 0.001 half-up."""
    criteria = context.criteria
    patchwork = (criteria is not None and PATCHWORK in criteria) or bool(
        context.labels & policy.patchwork_labels
    )
    if patchwork and not context.labels & policy.waiver_labels:
        # patchwork runs last whatever its size: the node term is not applied here
        return policy.patchwork_score.quantize(SCORE_QUANTUM, ROUND_HALF_UP)
    if criteria is not None:
        row = _project(row, criteria, policy)
    nodes = node_count_of(row)
    total = policy.base_score + policy.event.get(context.event, _D(0))
    total += policy.additional_node * (nodes - 1)
    if row.get("prefill") is not None:
        total += policy.multi_node
    if row.get("scenario-type") == "agentic-coding":
        total += policy.agentic
    if row.get("eval-only") is True:
        total += policy.eval_only
    total += policy.precision.get(str(row.get("precision", "")), _D(0))
    total += policy.spec_decoding.get(str(row.get("spec-decoding", "")), _D(0))
    framework_hit = _prefix_match(str(row.get("framework", "")), policy.framework_prefix)
    if framework_hit is not None:
        total += policy.framework_prefix[framework_hit]
    total += policy.model_prefix.get(str(row.get("model-prefix", "")), _D(0))
    if (criteria is not None and "checklist-complete" in criteria) or (
        context.labels & policy.checklist_labels
    ):
        total += policy.checklist
    return total.quantize(SCORE_QUANTUM, ROUND_HALF_UP)


def criteria_from_classifier(answer: object) -> frozenset[str]:
    """The classifier's criteria, or the fail-closed `{"patchwork"}` when its answer is unusable.

    Accepts the raw JSON text, or the decoded value: a list of strings, or an object with a
    `criteria` list. Unknown criterion names are kept so that `score()` rejects them loudly.
    """
    value = answer
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except ValueError:
            return FAIL_CLOSED
    if isinstance(value, Mapping):
        value = value.get("criteria")
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return FAIL_CLOSED
    return frozenset(value)


def queue_namespace(run_id: int, run_attempt: int, family: str | None = None) -> str:
    """`run_id:run_attempt[:family]`: tokens differ between runs and reruns of one matrix."""
    return f"{run_id}:{run_attempt}" + (f":{family}" if family else "")


def canonical_json(value: object) -> str:
    """The row as InferenceX's `queue_token` serializes it: sorted keys, no spaces, and
    non-ASCII text escaped (`json.dumps`' default `ensure_ascii`), so a row naming `café`
    hashes to the token InferenceX's own generator writes for it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def queue_token(row: Mapping[str, Any], namespace: str, path: Sequence[str] = ()) -> str:
    """First 32 hex digits of sha256 over `namespace:json-path:canonical-json(row)`."""
    material = f"{namespace}:{'/'.join(path)}:{canonical_json(row)}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def render_score(value: Decimal) -> str:
    return f"{value.quantize(SCORE_QUANTUM, ROUND_HALF_UP):.3f}"


def job_label(value: Decimal, token: str) -> str:
    """`ci-job-<score>-<token>`: the job's dispatch gate, carrying its priority."""
    if not token or not token.replace("-", "").isalnum() or token != token.lower():
        raise ValueError(
            f"queue token {token!r} must be lower-case letters, digits and dashes; "
            "use queue_token() to make one"
        )
    return f"{JOB_PREFIX}{render_score(value)}-{token}"
