"""The admission policy block: the skip-queue knobs round-trip, and the form refuses a wrong-way
rollback that the environment only warns about."""

from __future__ import annotations

import json
from uuid import uuid4

import pytest

from slurmgate.blocks import AdmissionPolicyBlock
from slurmgate.settings.admission import AdmissionSettings


def _through_a_block_document(block: AdmissionPolicyBlock) -> AdmissionPolicyBlock:
    """Save and load as Prefect does, without a server: the block document's data is stored as
    JSON and validated back into the block class."""
    document = block._to_block_document(
        name="policy", block_schema_id=uuid4(), block_type_id=uuid4()
    )
    return AdmissionPolicyBlock.model_validate(json.loads(json.dumps(document.data)))


def test_skip_queue_knobs_round_trip_through_the_block() -> None:
    block = AdmissionPolicyBlock(
        priority_scheduler_enabled=True,
        skip_queue_team="acme/ci-admins",
        skip_queue_allow=frozenset({"Alice", "bob"}),
        skip_queue_label="ci-urgent",
    )
    loaded = _through_a_block_document(block)
    settings = loaded.to_settings()
    assert settings.skip_queue_team == "acme/ci-admins"
    assert settings.skip_queue_allow == frozenset({"alice", "bob"})
    assert settings.skip_queue_label == "ci-urgent"
    assert AdmissionPolicyBlock.from_settings(settings).to_settings() == settings


def test_skip_queue_knobs_default_like_the_settings_and_refuse_bad_input() -> None:
    settings = AdmissionPolicyBlock().to_settings()
    defaults = AdmissionSettings()
    assert (settings.skip_queue_team, settings.skip_queue_allow, settings.skip_queue_label) == (
        defaults.skip_queue_team,
        defaults.skip_queue_allow,
        defaults.skip_queue_label,
    )
    with pytest.raises(ValueError, match="org/team-slug"):
        AdmissionPolicyBlock(skip_queue_team="just-a-team")


def test_the_form_refuses_node_slots_without_priority_naming_both_fields() -> None:
    with pytest.raises(ValueError) as info:
        AdmissionPolicyBlock(node_slot_scheduler_enabled=True)
    message = str(info.value)
    assert "node_slot_scheduler_enabled=true needs priority_scheduler_enabled=true" in message
    assert "save node_slot_scheduler_enabled=false first" in message
    # the same flags from the environment are a warning, not an error (tests/admission)
    assert AdmissionSettings(NODE_SLOT_SCHEDULER_ENABLED=True).flag_warnings
