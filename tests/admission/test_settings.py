"""AdmissionSettings: environment names, defaults, the flag dependency, the queued-lease limit."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from admission_kit import NOW, ON, job, lease_runners, pool, snapshot
from pydantic import ValidationError

from slurmgate.admission.planner import plan
from slurmgate.settings.admission import AdmissionSettings

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
    assert (s.reserve_after_s, s.estimates, s.wide_fraction) == (3600, "learned", 0.25)
    assert (s.lease_max_queued_age_s, s.orphan_grace_s) == (None, 30)
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


def test_node_slots_without_priority_is_node_slots_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rollback done the wrong way round must not stop the ticks that drain the leases."""
    monkeypatch.setenv("NODE_SLOT_SCHEDULER_ENABLED", "true")
    s = AdmissionSettings()
    assert s.node_slots is False
    [warning] = s.flag_warnings
    assert "NODE_SLOT_SCHEDULER_ENABLED=true is ignored" in warning
    assert "turn NODE_SLOT_SCHEDULER_ENABLED off first" in warning


@pytest.mark.parametrize(
    ("value", "on", "noted"),
    [
        ("true", True, False),
        ("TRUE", True, False),
        ("True", True, False),
        ("false", False, False),
        ("", False, False),
        ("1", False, True),
        ("yes", False, True),
        ("on", False, True),
    ],
)
def test_a_flag_is_on_only_when_it_is_true_in_any_case(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool, noted: bool
) -> None:
    """As the workflow templates test it (`vars.FLAG == 'true'`, case-insensitive): a `1` that
    pydantic reads as on would make the controller admit jobs the workflow labelled as off."""
    monkeypatch.setenv("PRIORITY_SCHEDULER_ENABLED", value)
    s = AdmissionSettings()
    assert s.PRIORITY_SCHEDULER_ENABLED is on
    assert bool(s.flag_warnings) is noted
    if noted:
        [warning] = s.flag_warnings
        assert f"PRIORITY_SCHEDULER_ENABLED={value!r} reads as off" in warning
    # keyword values (the policy block's bools) are themselves
    assert AdmissionSettings(PRIORITY_SCHEDULER_ENABLED=True).PRIORITY_SCHEDULER_ENABLED


def test_queued_lease_limit_defaults_to_the_job_timeout() -> None:
    s = AdmissionSettings()
    assert s.lease_max_queued_age_s is None
    assert s.queued_lease_limit_s("benchmark dsr1 8k1k") == 480 * 60
    assert s.queued_lease_limit_s("agentic kimik3") == 780 * 60
    shorter = AdmissionSettings(timeout_min=30)
    assert shorter.queued_lease_limit_s("benchmark") == 30 * 60


def test_queued_lease_limit_takes_an_explicit_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_LEASE_MAX_QUEUED_AGE_S", "3600")
    s = AdmissionSettings()
    assert s.queued_lease_limit_s("benchmark") == s.queued_lease_limit_s("agentic") == 3600


def test_a_queued_lease_expires_at_its_limit() -> None:
    queued = job(1, 2)
    runners = lease_runners(pool("x", 2), queued, [1, 2])

    def released(settings: AdmissionSettings, age_s: float) -> list[str]:
        decisions = plan(snapshot(runners, [queued]), settings, NOW + timedelta(seconds=age_s))
        return [r.reason.value for r in decisions.release]

    # by default the seed's patience, bounded by the job's timeout (480 min)
    assert released(ON, 3601) == []  # the old 1 h default released it here
    assert released(ON, 480 * 60 - 1) == []
    assert released(ON, 480 * 60 + 1) == ["expired-while-queued"]
    explicit = ON.model_copy(update={"lease_max_queued_age_s": 600.0})
    assert released(explicit, 599) == []
    assert released(explicit, 601) == ["expired-while-queued"]


def test_unknown_policy_and_bad_knobs_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMGATE_POLICY", "fifo")
    with pytest.raises(ValidationError, match="greedy"):
        AdmissionSettings()
    monkeypatch.delenv("SLURMGATE_POLICY")
    with pytest.raises(ValidationError, match="lease_max_queued_age_s"):
        AdmissionSettings(lease_max_queued_age_s=0)
    with pytest.raises(ValidationError, match="default_priority"):
        AdmissionSettings(default_priority="NaN")
