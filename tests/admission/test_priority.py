"""The seed's priority formula (docs/seed.md): worked values, fail-closed, token and label."""

from __future__ import annotations

import hashlib
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmgate.admission.labels import JobLabel
from slurmgate.ci.priority import (
    DEFAULT_POLICY,
    PriorityContext,
    PriorityPolicyError,
    criteria_from_classifier,
    job_label,
    load_priority_policy,
    queue_namespace,
    queue_token,
    score,
)

INFERENCEX_POLICY = Path(__file__).resolve().parents[2] / "examples" / "github" / "ci-priority.yaml"

BASELINE = {"runner": "h100", "framework": "trt", "precision": "fp8", "model-prefix": "llama"}
HIGH_VALUE = {
    "runner": "gb200",
    "framework": "sglang",
    "precision": "fp4",
    "spec-decoding": "mtp",
    "model-prefix": "dsv4",
    "scenario-type": "agentic-coding",
    "prefill": {"num-worker": 1, "tp": 4},
    "decode": {"num-worker": 1, "tp": 4},
}


def test_baseline_single_node_is_one() -> None:
    assert score(BASELINE, PriorityContext(event="pull_request")) == Decimal("1.000")


@pytest.mark.parametrize(("nodes", "expected"), [(1, "1.000"), (2, "0.999"), (3, "0.998")])
def test_each_extra_node_costs_a_thousandth(nodes: int, expected: str) -> None:
    assert score({**BASELINE, "node-count": nodes}) == Decimal(expected)


def test_classifier_with_empty_criteria_passes_node_count_through() -> None:
    row = {**HIGH_VALUE, "node-count": 3}
    assert score(row, PriorityContext(criteria=frozenset())) == Decimal("0.998")


def test_push_event_adds_two() -> None:
    assert score(BASELINE, PriorityContext(event="push")) == Decimal("3.000")


def test_high_value_multinode_row_and_its_eighteen_node_tie_break() -> None:
    assert score(HIGH_VALUE) == Decimal("6.000")
    assert score({**HIGH_VALUE, "node-count": 18}) == Decimal("5.983")


def test_classifier_projection_counts_only_confirmed_facts() -> None:
    confirmed = frozenset({"sglang", "fp4", "multi-node"})
    # framework 0.5 + fp4 0.75 + multinode 1.25; dsv4, mtp and agentic are not confirmed
    assert score(HIGH_VALUE, PriorityContext(criteria=confirmed)) == Decimal("3.500")


def test_skip_queue_pr_with_sglang_and_fp4() -> None:
    row = {**BASELINE, "framework": "sglang-lmsys", "precision": "fp4", "skip-queue-pr": 42}
    assert score(row, PriorityContext(event="pull_request", labels=frozenset({"skip_queue"}))) == (
        Decimal("2.250")
    )


def test_checklist_label_adds_a_quarter() -> None:
    ctx = PriorityContext(labels=frozenset({"ci-checklist-complete"}))
    assert score(BASELINE, ctx) == Decimal("1.250")


def test_patchwork_is_zero_whatever_the_row_and_a_waiver_lifts_it() -> None:
    patch = PriorityContext(event="push", labels=frozenset({"ci-patchwork"}))
    assert score({**HIGH_VALUE, "node-count": 18}, patch) == Decimal("0.000")
    waived = PriorityContext(labels=frozenset({"engine-patch", "ci-patchwork-waived"}))
    assert score(HIGH_VALUE, waived) == Decimal("6.000")


def test_patchwork_score_rounds_half_up() -> None:
    policy = DEFAULT_POLICY.model_copy(update={"patchwork_score": Decimal("0.7225")})
    ctx = PriorityContext(criteria=frozenset({"patchwork"}))
    assert score(BASELINE, ctx, policy) == Decimal("0.723")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_invalid_node_count_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        score({**BASELINE, "node-count": bad})


@pytest.mark.parametrize("answer", ["", "not json", "{}", '{"criteria": "fp4"}', "[1, 2]", None])
def test_malformed_classifier_answer_fails_closed_to_patchwork(answer: object) -> None:
    criteria = criteria_from_classifier(answer)
    assert criteria == frozenset({"patchwork"})
    assert score(HIGH_VALUE, PriorityContext(criteria=criteria)) == Decimal("0.000")


def test_well_formed_classifier_answer_is_used() -> None:
    assert criteria_from_classifier('{"criteria": ["fp4", "sglang"]}') == {"fp4", "sglang"}
    assert criteria_from_classifier(["mtp"]) == {"mtp"}


def test_unknown_criterion_raises() -> None:
    with pytest.raises(ValueError, match="unknown priority criteria"):
        score(BASELINE, PriorityContext(criteria=frozenset({"fp4", "quantum"})))


def test_queue_token_is_sha256_of_namespace_path_and_canonical_row() -> None:
    ns = queue_namespace(123, 2, "multinode")
    assert ns == "123:2:multinode"
    row = {"b": 1, "a": [1, 2]}
    expected = hashlib.sha256(b'123:2:multinode:0/config:{"a":[1,2],"b":1}').hexdigest()[:32]
    assert queue_token(row, ns, ("0", "config")) == expected
    assert queue_token({"a": [1, 2], "b": 1}, ns, ("0", "config")) == expected  # key order
    assert queue_token(row, queue_namespace(123, 3, "multinode"), ("0", "config")) != expected


def test_the_token_of_a_row_with_non_ascii_text_hashes_inferencex_canonical_json() -> None:
    # InferenceX's queue_token: json.dumps(row, sort_keys=True, separators=(",", ":")), whose
    # default ensure_ascii escapes every non-ASCII character; the bytes are written out here
    row = {"model": "café-模型", "conc": [4]}
    material = b'7:1:config/0:{"conc":[4],"model":"caf\\u00e9-\\u6a21\\u578b"}'
    assert queue_token(row, "7:1", ("config", "0")) == hashlib.sha256(material).hexdigest()[:32]


def test_inferencex_policy_file_gives_the_seeds_weights() -> None:
    """The seed's own configs/ci-priority.yaml (examples/github/SOURCE.md) reads as exactly
    the weights slurmgate uses by default."""
    assert load_priority_policy(INFERENCEX_POLICY) == DEFAULT_POLICY


def test_a_policy_file_changes_the_score_and_missing_weights_count_zero(tmp_path: Path) -> None:
    text = INFERENCEX_POLICY.read_text()
    path = tmp_path / "policy.yaml"
    path.write_text(text.replace("push: 2.0", "push: 4.5").replace("additional-node: -0.001", ""))
    policy = load_priority_policy(path)
    row = {**BASELINE, "node-count": 3}
    # push is 4.5, and without additional-node (InferenceX reads a missing weight as 0) the
    # node count no longer costs anything
    assert score(row, PriorityContext(event="push"), policy) == Decimal("5.500")
    assert score(row, PriorityContext(event="push")) == Decimal("2.998")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("version: 1", "version: 2"), "unsupported version 2; only version 1"),
        (("version: 1", "version: true"), "unsupported version True"),
        (("version: 1\n", ""), "unsupported version None"),
        (("multi-node: 1.25", "multi-nodes: 1.25"), "adjustments.multi-nodes: Extra inputs"),
        (("fp4: 0.75", "fp4: lots"), r"adjustments.precision.fp4: must be a number"),
        (("base-score: 1.0", "base-score: .nan"), "base-score: must be a finite number"),
        (("    score: 0.0\n", ""), "labels.patchwork.score: Field required"),
    ],
)
def test_a_bad_policy_file_is_one_line_naming_the_field(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    text = INFERENCEX_POLICY.read_text()
    assert change[0] in text
    path = tmp_path / "policy.yaml"
    path.write_text(text.replace(change[0], change[1], 1))
    with pytest.raises(PriorityPolicyError, match=message) as caught:
        load_priority_policy(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_job_label_round_trips_through_the_planner_parser() -> None:
    token = queue_token(BASELINE, "1:1")
    label = job_label(Decimal("5.983"), token)
    assert label == f"ci-job-5.983-{token}"
    parsed = JobLabel.parse(label)
    assert (parsed.score, parsed.token) == (Decimal("5.983"), token)
    with pytest.raises(ValueError, match="queue token"):
        job_label(Decimal(1), "Not_A_Token")


business = st.lists(
    st.sampled_from(["push", "multi", "agentic", "fp4", "mtp", "sglang", "kimik3", "dsr1"]),
    unique=True,
)


def _row(facts: list[str], nodes: int) -> tuple[dict[str, object], PriorityContext]:
    row: dict[str, object] = {"runner": "b300", "framework": "trt", "node-count": nodes}
    if "multi" in facts:
        row["prefill"] = {}
    if "agentic" in facts:
        row["scenario-type"] = "agentic-coding"
    if "fp4" in facts:
        row["precision"] = "fp4"
    if "mtp" in facts:
        row["spec-decoding"] = "mtp"
    if "sglang" in facts:
        row["framework"] = "sglang"
    for model in ("kimik3", "dsr1"):
        if model in facts:
            row["model-prefix"] = model
    return row, PriorityContext(event="push" if "push" in facts else "pull_request")


@given(business, business, st.integers(1, 250), st.integers(1, 250))
def test_node_term_never_reorders_business_priority(
    a: list[str], b: list[str], nodes_a: int, nodes_b: int
) -> None:
    row_a, ctx_a = _row(a, nodes_a)
    row_b, ctx_b = _row(b, nodes_b)
    base_a, base_b = (
        score({**row_a, "node-count": 1}, ctx_a),
        score({**row_b, "node-count": 1}, ctx_b),
    )
    if abs(base_a - base_b) < Decimal("0.25"):
        return
    assert (base_a > base_b) == (score(row_a, ctx_a) > score(row_b, ctx_b))
