"""The seed's priority formula (docs/seed.md): worked values, fail-closed, token and label."""

from __future__ import annotations

import hashlib
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmgate.admission.labels import JobLabel
from slurmgate.ci.priority import (
    DEFAULT_POLICY,
    PriorityContext,
    criteria_from_classifier,
    job_label,
    queue_namespace,
    queue_token,
    score,
)

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
