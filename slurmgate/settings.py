"""Admission settings: the two seed feature flags and the planner knobs, from the environment."""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class AdmissionSettings(BaseSettings):
    """What the planner reads besides the snapshot.

    Environment variables: the seed's two flags keep their bare names
    (`PRIORITY_SCHEDULER_ENABLED`, `NODE_SLOT_SCHEDULER_ENABLED`); the policy knobs are
    `SLURMGATE_POLICY`, `SLURMGATE_LEASE_MAX_QUEUED_AGE_S`, `SLURMGATE_ORPHAN_GRACE_S` and
    `SLURMGATE_DEFAULT_PRIORITY`. Keyword arguments use the field names.

    With `PRIORITY_SCHEDULER_ENABLED` false the planner is inert for admission: it admits and
    cleans nothing, and only releases leases whose job finished or vanished, so switching the
    feature off drains cleanly. With `NODE_SLOT_SCHEDULER_ENABLED` false every job counts as one
    node: its `nodes:` label is ignored for sizing but is still a gate label on the anchor.
    """

    model_config = SettingsConfigDict(env_prefix="", populate_by_name=True, extra="ignore")

    PRIORITY_SCHEDULER_ENABLED: bool = Field(
        default=False,
        description="Admit queued jobs by weighted runner leases in priority order.",
    )
    NODE_SLOT_SCHEDULER_ENABLED: bool = Field(
        default=False,
        description=(
            "Size each job by its nodes:N label (needs PRIORITY_SCHEDULER_ENABLED); "
            "when false every job counts as 1 node."
        ),
    )
    policy: Literal["greedy"] = Field(
        default="greedy",
        validation_alias=AliasChoices("policy", "SLURMGATE_POLICY"),
        description="Ordering and fit policy of the planner (env SLURMGATE_POLICY).",
    )
    lease_max_queued_age_s: float = Field(
        default=3600.0,
        gt=0,
        validation_alias=AliasChoices("lease_max_queued_age_s", "SLURMGATE_LEASE_MAX_QUEUED_AGE_S"),
        description=(
            "A lease older than this while its job is still queued is released "
            "(env SLURMGATE_LEASE_MAX_QUEUED_AGE_S, seconds)."
        ),
    )
    orphan_grace_s: float = Field(
        default=30.0,
        ge=0,
        validation_alias=AliasChoices("orphan_grace_s", "SLURMGATE_ORPHAN_GRACE_S"),
        description=(
            "A lease without an anchor younger than this is left alone, because another "
            "controller may be between its label and anchor steps "
            "(env SLURMGATE_ORPHAN_GRACE_S, seconds)."
        ),
    )
    default_priority: Decimal = Field(
        default=Decimal("1.000"),
        validation_alias=AliasChoices("default_priority", "SLURMGATE_DEFAULT_PRIORITY"),
        description=(
            "Score of a job without a ci-job-<score>-<token> label "
            "(env SLURMGATE_DEFAULT_PRIORITY, decimal, 3 places)."
        ),
    )

    @field_validator("default_priority")
    @classmethod
    def _three_places(cls, value: Decimal) -> Decimal:
        return value.quantize(Decimal("0.001"))

    @model_validator(mode="after")
    def _node_slot_needs_priority(self) -> AdmissionSettings:
        if self.NODE_SLOT_SCHEDULER_ENABLED and not self.PRIORITY_SCHEDULER_ENABLED:
            raise ValueError(
                "NODE_SLOT_SCHEDULER_ENABLED=true requires PRIORITY_SCHEDULER_ENABLED=true; "
                "set PRIORITY_SCHEDULER_ENABLED=true as well, or unset NODE_SLOT_SCHEDULER_ENABLED"
            )
        return self

    @property
    def node_slots(self) -> bool:
        """True when jobs are sized by their nodes:N label (both flags on)."""
        return self.PRIORITY_SCHEDULER_ENABLED and self.NODE_SLOT_SCHEDULER_ENABLED
