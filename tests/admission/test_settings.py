"""AdmissionSettings: environment names, defaults, and the flag dependency."""

from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import ValidationError

from slurmgate.admission.settings import AdmissionSettings

ENV = (
    "PRIORITY_SCHEDULER_ENABLED",
    "NODE_SLOT_SCHEDULER_ENABLED",
    "SLURMGATE_POLICY",
    "SLURMGATE_LEASE_MAX_QUEUED_AGE_S",
    "SLURMGATE_ORPHAN_GRACE_S",
    "SLURMGATE_DEFAULT_PRIORITY",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_disabled_and_documented_values() -> None:
    s = AdmissionSettings()
    assert (s.PRIORITY_SCHEDULER_ENABLED, s.NODE_SLOT_SCHEDULER_ENABLED) == (False, False)
    assert s.policy == "easy"  # the best-measured starvation-free policy (bench_policies)
    assert s.reserve_after_s == 18000 and s.estimates == "learned"
    assert (s.lease_max_queued_age_s, s.orphan_grace_s) == (3600, 30)
    assert str(s.default_priority) == "1.000"
    assert s.node_slots is False


def test_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIORITY_SCHEDULER_ENABLED", "true")
    monkeypatch.setenv("NODE_SLOT_SCHEDULER_ENABLED", "true")
    monkeypatch.setenv("SLURMGATE_LEASE_MAX_QUEUED_AGE_S", "120")
    monkeypatch.setenv("SLURMGATE_ORPHAN_GRACE_S", "5")
    monkeypatch.setenv("SLURMGATE_DEFAULT_PRIORITY", "0.5")
    s = AdmissionSettings()
    assert s.node_slots is True
    assert (s.lease_max_queued_age_s, s.orphan_grace_s) == (120, 5)
    assert s.default_priority == Decimal("0.500") and str(s.default_priority) == "0.500"


def test_node_slots_without_priority_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_SLOT_SCHEDULER_ENABLED", "true")
    with pytest.raises(ValidationError) as info:
        AdmissionSettings()
    message = str(info.value)
    assert "NODE_SLOT_SCHEDULER_ENABLED=true requires PRIORITY_SCHEDULER_ENABLED=true" in message
    assert "set PRIORITY_SCHEDULER_ENABLED=true" in message


def test_unknown_policy_and_bad_knobs_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_POLICY", "fifo")
    with pytest.raises(ValidationError, match="greedy"):
        AdmissionSettings()
    monkeypatch.delenv("SLURMGATE_POLICY")
    with pytest.raises(ValidationError, match="lease_max_queued_age_s"):
        AdmissionSettings(lease_max_queued_age_s=0)
    with pytest.raises(ValidationError, match="default_priority"):
        AdmissionSettings(default_priority="NaN")
