"""The root of the settings tree: every part, composed; each part reads its own variables."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from slurmgate.settings.admission import AdmissionMetricsSettings, AdmissionSettings
from slurmgate.settings.ci import CISettings
from slurmgate.settings.github import EventReadSettings, GitHubSettings
from slurmgate.settings.home import HomeSettings
from slurmgate.settings.prefect import PrefectSettings
from slurmgate.settings.runtime import LedgerSettings, NodeRetrySettings, OutputsSettings
from slurmgate.settings.slurm import SlurmRestSettings
from slurmgate.settings.testbed import LocalClusterSettings


class Settings(BaseModel):
    """Every variable an operator sets, by part. Build one part where it is used (a bad value
    of one part never stops a command that does not read it); build this to read them all."""

    model_config = ConfigDict(frozen=True)

    home: HomeSettings = Field(
        default_factory=HomeSettings, description="Where slurmgate keeps its state and its runs."
    )
    admission: AdmissionSettings = Field(
        default_factory=AdmissionSettings,
        description="The seed's feature flags and the planner's knobs (the policy block's "
        "fields, as environment variables).",
    )
    metrics: AdmissionMetricsSettings = Field(
        default_factory=AdmissionMetricsSettings,
        description="Where each tick's metrics go besides /metrics.",
    )
    github: GitHubSettings = Field(
        default_factory=GitHubSettings,
        description="GitHub credentials and pace of the commands and inline scopes, and the "
        "webhook relay's secret.",
    )
    events: EventReadSettings = Field(
        default_factory=EventReadSettings,
        description="How the tick uses the webhook relay's job events.",
    )
    slurmrestd: SlurmRestSettings = Field(
        default_factory=SlurmRestSettings,
        description="Slurm's REST API as the capacity read's source, instead of its commands.",
    )
    ledger: LedgerSettings = Field(
        default_factory=LedgerSettings,
        description="The controller's heartbeat and the reaper of runs whose controller died.",
    )
    node_failures: NodeRetrySettings = Field(
        default_factory=NodeRetrySettings,
        description="What an allocation run does when one node fails it.",
    )
    outputs: OutputsSettings = Field(
        default_factory=OutputsSettings,
        description="What an allocation run collects from its nodes before cleanup.",
    )
    prefect: PrefectSettings = Field(
        default_factory=PrefectSettings,
        description="Prefect's variables that slurmgate's commands read themselves.",
    )
    ci: CISettings = Field(
        default_factory=CISettings,
        description="What a GitHub workflow step hands `slurmgate labels`.",
    )
    local_cluster: LocalClusterSettings = Field(
        default_factory=LocalClusterSettings,
        description="The bundled local Slurm cluster of `slurmgate cluster up`.",
    )


@dataclass(frozen=True)
class Variable:
    """One environment variable of the tree: its part, its field, its name and its field info."""

    part: str
    model: type[BaseModel]
    field: str
    name: str
    info: FieldInfo


def env_name(model: type[BaseModel], field: str) -> str:
    """The environment variable a part's field reads: its alias named in full (the
    `SLURMGATE_` one of a planner knob's two), else the part's prefix and the field's name."""
    alias = model.model_fields[field].validation_alias
    if isinstance(alias, str):
        return alias
    if isinstance(alias, AliasChoices):
        names = [str(choice) for choice in alias.choices]
        return next((n for n in names if n.startswith("SLURMGATE_")), names[-1])
    prefix = str(model.model_config.get("env_prefix", ""))
    return f"{prefix}{field}".upper() if prefix else field


def variables() -> list[Variable]:
    """Every variable of the tree, part by part, each in its part's order."""
    found = []
    for part, info in Settings.model_fields.items():
        model = info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for field, field_info in model.model_fields.items():
            found.append(Variable(part, model, field, env_name(model, field), field_info))
    return found
