"""Hostile skip-queue answers: label events, team memberships and a run's pull requests.

Whatever GitHub sends, a label event is read, passed over, or refused as MalformedPayload; a
login that is no GitHub login is never believed; a run's pull requests are numbers or nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmgate.admission.labels import MAX_PR_NUMBER
from slurmgate.github.payloads import (
    LabelEvent,
    MalformedPayload,
    parse_label_event,
    parse_run_pull_requests,
    parse_team_membership,
)

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=60),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
LOGINS = st.sampled_from(["alice", "A-b", "bot[bot]", "x" * 39]) | st.text(max_size=80)
EVENTS = st.fixed_dictionaries(
    {
        "id": st.integers(-5, 2**64) | JSON,
        "event": st.sampled_from(["labeled", "unlabeled", "assigned"]) | JSON,
        "actor": st.none() | st.fixed_dictionaries({"login": LOGINS | JSON}) | JSON,
        "label": st.fixed_dictionaries({"name": st.text(max_size=300) | JSON}) | JSON,
    }
)


def label_event(event_id: int, login: Any, kind: str = "labeled") -> dict[str, Any]:
    return {
        "id": event_id,
        "event": kind,
        "actor": {"login": login, "id": 1, "type": "User"},
        "label": {"name": "Skip_Queue", "color": "ededed"},
        "created_at": "2026-12-01T00:00:00Z",
    }


def test_a_well_formed_label_event_is_read_case_folded() -> None:
    assert parse_label_event(label_event(7, "Alice")) == LabelEvent(7, True, "skip_queue", "alice")
    assert parse_label_event(label_event(8, "ci-app[bot]", "unlabeled")) == LabelEvent(
        8, False, "skip_queue", "ci-app[bot]"
    )
    assert parse_label_event({**label_event(9, "x"), "actor": None}) == LabelEvent(
        9, True, "skip_queue", None
    )
    assert parse_label_event({"event": "assigned", "anything": object()}) is None


@pytest.mark.parametrize(
    "login",
    [
        "",
        "a" * 40,
        "-alice",
        "al--ice",
        "al ice",
        "../x",
        "alice\n",
        "[bot]",
        "a" * 40 + "[bot]",
        7,
    ],
)
def test_a_login_that_is_no_github_login_is_refused(login: Any) -> None:
    with pytest.raises(MalformedPayload):
        parse_label_event(label_event(1, login))


@FUZZ
@given(value=EVENTS | JSON)
def test_anything_is_an_event_none_or_a_malformed_payload(value: Any) -> None:
    try:
        event = parse_label_event(value)
    except MalformedPayload as exc:
        assert len(str(exc)) < 700
        return
    if event is not None:
        assert 1 <= event.id < 2**63 and len(event.label) <= 256
        assert event.actor is None or len(event.actor) <= 39 + len("[bot]")


@FUZZ
@given(value=JSON | st.fixed_dictionaries({"pull_requests": st.lists(JSON, max_size=3) | JSON}))
def test_a_runs_pull_requests_are_numbers_or_nothing(value: Any) -> None:
    numbers = parse_run_pull_requests(value)
    assert all(1 <= n <= MAX_PR_NUMBER for n in numbers)


def test_run_pull_requests_and_membership_shapes() -> None:
    assert parse_run_pull_requests({"pull_requests": [{"number": 3}, {"number": 4}]}) == {3, 4}
    assert parse_run_pull_requests({"pull_requests": [{"number": 2**31}]}) == frozenset()
    assert parse_run_pull_requests({"pull_requests": [{"number": "3"}]}) == frozenset()
    assert parse_run_pull_requests({"pull_requests": [{"number": 1}] * 101}) == frozenset()
    assert parse_team_membership({"state": "active", "role": "member"}) is True
    assert parse_team_membership({"state": "pending"}) is False
    assert parse_team_membership({"state": "Active"}) is False
    for bad in ({}, {"state": None}, [], "active"):
        with pytest.raises(MalformedPayload):
            parse_team_membership(bad)
