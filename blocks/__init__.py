"""Prefect blocks for slurmgate: the GitHub scope with its token, and the admission policy."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from slurmgate.admission.estimates import RuntimeHistory
from slurmgate.github.app_auth import GitHubAppCredentials
from slurmgate.github.client import GitHubClient
from slurmgate.github.factory import client_for_scope
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import (
    AdmissionSettings,
    EstimatesName,
    PolicyName,
    PoolPartition,
    RepoLimits,
    SlurmCluster,
    TeamLimits,
)


class _SlurmgateBlock(Block):
    """What every slurmgate block shares: where its documentation lives."""

    _documentation_url = "https://github.com/slurmgate/slurmgate#blocks"  # type: ignore[assignment]


class GitHubScopeBlock(_SlurmgateBlock):
    """Where slurmgate reads runners and jobs: a GitHub API, a repository or org, and how to
    authenticate: a token, or a GitHub App (its id, private key and, optionally, installation id).

    The token and the App's private key are secrets: masked in the UI and API, never logged.

    Examples:
        ```python
        from slurmgate.blocks import GitHubScopeBlock
        GitHubScopeBlock(repo="acme/bench", token="ghp_...").save("BLOCK_NAME")
        # or as a GitHub App:
        # GitHubScopeBlock(repo="acme/bench", app_id=123456,
        #                  app_private_key=open("app.pem").read()).save("BLOCK_NAME")
        scope = GitHubScopeBlock.load("BLOCK_NAME")
        async with scope.get_client() as github:
            runners = await github.list_runners()
        ```
    """

    _block_type_name = "slurmgate GitHub Scope"
    _block_type_slug = "slurmgate-github-scope"

    api_url: str = Field(
        default="https://api.github.com",
        description="Base URL of the GitHub REST API (or of the slurmgate emulator).",
    )
    repo: str | None = Field(
        default=None,
        description="Repository scope as OWNER/NAME; set this or org, not both.",
    )
    org: str | None = Field(
        default=None,
        description="Organization scope (runners registered at org level); set this or repo.",
    )
    repos: list[str] = Field(
        default_factory=list,
        description=(
            "With an org scope: the OWNER/NAME repositories whose queued jobs are read "
            "(runners are org-wide, workflow jobs belong to repositories)."
        ),
    )
    all_repos: bool = Field(
        default=False,
        description=(
            "With an org scope and no repos: read jobs from every repository the token or "
            "App installation can see (GET /orgs/{org}/repos), one shared pool."
        ),
    )
    # a refused value must not be echoed back in the error (it may be the token or the key)
    model_config = ConfigDict(hide_input_in_errors=True)

    token: SecretStr | None = Field(
        default=None,
        description=(
            "GitHub token with admin rights on the repository's or org's runners; "
            "leave empty to authenticate as a GitHub App (app_id, app_private_key)."
        ),
    )
    app_id: int | None = Field(
        default=None,
        gt=0,
        description="GitHub App id (the App's settings page: 'App ID'), instead of a token.",
    )
    app_private_key: SecretStr | None = Field(
        default=None,
        description="The GitHub App's private key: the text of the .pem file GitHub generated.",
    )
    app_installation_id: int | None = Field(
        default=None,
        gt=0,
        description=(
            "The App's installation id; empty: looked up from the organization or repository."
        ),
    )
    min_write_interval_s: float = Field(
        default=1.0,
        ge=0,
        description="Minimum spacing between label writes, in seconds (GitHub asks for >= 1 s).",
    )
    request_retries: int = Field(
        default=4,
        ge=0,
        le=10,
        description="Retries of one request on 5xx, timeouts and rate limits inside the client.",
    )

    @model_validator(mode="after")
    def _valid_scope(self) -> GitHubScopeBlock:
        self.scope()  # the core's GitHubScope is the one definition of a valid scope
        self.credentials()
        return self

    def credentials(self) -> SecretStr | GitHubAppCredentials:
        """The token, or the GitHub App credentials; raises ValueError naming the field."""
        app_fields = (self.app_id, self.app_private_key, self.app_installation_id)
        if self.token is not None and self.token.get_secret_value().strip():
            if any(value is not None for value in app_fields):
                raise ValueError(
                    "set either token or the GitHub App fields (app_id, app_private_key), "
                    "not both; clear the one you do not use"
                )
            return self.token
        if self.app_id is None or self.app_private_key is None:
            raise ValueError(
                "no credentials: set token (a GitHub token with admin rights on the runners), "
                "or app_id and app_private_key (a GitHub App installed on the repository or org)"
            )
        return GitHubAppCredentials(self.app_id, self.app_private_key, self.app_installation_id)

    def scope(self) -> GitHubScope:
        """The scope this block names; raises ValueError naming the field and the fix."""
        try:
            return GitHubScope(
                api_url=self.api_url,
                repo=self.repo,
                org=self.org,
                repos=tuple(self.repos),
                all_repos=self.all_repos,
            )
        except ValidationError as exc:
            raise ValueError(
                "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            ) from None

    @property
    def scope_name(self) -> str:
        """`repo:OWNER/NAME` or `org:NAME`, for logs and state file names."""
        return f"repo:{self.repo}" if self.repo else f"org:{self.org}"

    def get_client(self, **overrides: Any) -> GitHubClient:
        """A GitHub client for this scope, with its file ETag cache; use it as an async context
        manager. `overrides` go to the client."""
        options: dict[str, Any] = {
            "min_write_interval_s": self.min_write_interval_s,
            "max_retries": self.request_retries,
            **overrides,
        }
        return client_for_scope(self.scope(), self.credentials(), **options)


def _knob(name: str) -> Any:
    """A block field with the default and description of the same AdmissionSettings knob.

    The settings stay the one definition of every knob; the block only mirrors them for the UI.
    """
    field = AdmissionSettings.model_fields[name]
    if field.default_factory is not None:
        return Field(default_factory=field.default_factory, description=field.description)
    return Field(default=field.default, description=field.description)


class _BlockSettings(AdmissionSettings):
    """AdmissionSettings from a block's fields alone (no environment, no dotenv)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        *others: PydanticBaseSettingsSource,
        **named: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


# block field -> AdmissionSettings field (the two seed flags keep their environment names there)
_FLAG_FIELDS = {
    "priority_scheduler_enabled": "PRIORITY_SCHEDULER_ENABLED",
    "node_slot_scheduler_enabled": "NODE_SLOT_SCHEDULER_ENABLED",
}


class AdmissionPolicyBlock(_SlurmgateBlock):
    """The admission policy: the two feature flags and the planner knobs (as AdmissionSettings).

    Examples:
        ```python
        from slurmgate.blocks import AdmissionPolicyBlock
        AdmissionPolicyBlock(priority_scheduler_enabled=True,
                             node_slot_scheduler_enabled=True, policy="easy").save("BLOCK_NAME")
        policy = AdmissionPolicyBlock.load("BLOCK_NAME")
        settings = policy.to_settings()
        ```
    """

    _block_type_name = "slurmgate Admission Policy"
    _block_type_slug = "slurmgate-admission-policy"

    priority_scheduler_enabled: bool = _knob("PRIORITY_SCHEDULER_ENABLED")
    node_slot_scheduler_enabled: bool = _knob("NODE_SLOT_SCHEDULER_ENABLED")
    policy: PolicyName = _knob("policy")
    estimates: EstimatesName = _knob("estimates")
    timeout_min: float = _knob("timeout_min")
    timeout_overrides: dict[str, float] = _knob("timeout_overrides")
    estimate_quantile: float = _knob("estimate_quantile")
    estimate_min_samples: int = _knob("estimate_min_samples")
    overrun_extension_s: float = _knob("overrun_extension_s")
    reserve_after_s: float = _knob("reserve_after_s")
    wide_fraction: float | None = _knob("wide_fraction")
    reservation_depth: int = _knob("reservation_depth")
    lease_max_queued_age_s: float | None = _knob("lease_max_queued_age_s")
    orphan_grace_s: float = _knob("orphan_grace_s")
    skip_queue_team: str | None = _knob("skip_queue_team")
    skip_queue_allow: frozenset[str] = _knob("skip_queue_allow")
    skip_queue_label: str = _knob("skip_queue_label")
    default_priority: Decimal = _knob("default_priority")
    pool_partitions: dict[str, PoolPartition] = _knob("pool_partitions")
    slurm_clusters: dict[str, SlurmCluster] = _knob("slurm_clusters")
    cordoned_pools: dict[str, str] = _knob("cordoned_pools")
    repo_limits: dict[str, RepoLimits] = _knob("repo_limits")
    teams: dict[str, TeamLimits] = _knob("teams")
    fair_share: bool = _knob("fair_share")

    @model_validator(mode="after")
    def _valid_settings(self) -> AdmissionPolicyBlock:
        # From the environment the settings only warn about this (a refused tick would stop
        # releasing finished leases); here a person is typing, so the form refuses it.
        if self.node_slot_scheduler_enabled and not self.priority_scheduler_enabled:
            raise ValueError(
                "node_slot_scheduler_enabled=true needs priority_scheduler_enabled=true "
                "(NODE_SLOT_SCHEDULER_ENABLED=true requires PRIORITY_SCHEDULER_ENABLED=true): "
                "turn priority_scheduler_enabled on, or node_slot_scheduler_enabled off. To roll "
                "back, save node_slot_scheduler_enabled=false first, then "
                "priority_scheduler_enabled=false."
            )
        self.to_settings()  # a bad knob fails when the block is built, naming the field
        return self

    def to_settings(self) -> AdmissionSettings:
        """The planner settings this block describes, and only those: the environment of the
        process that loads it adds nothing (pydantic-settings would merge a SLURMGATE_* JSON
        mapping into the block's own); raises naming the field on bad input."""
        values = {
            _FLAG_FIELDS.get(name, name): getattr(self, name)
            for name in type(self).model_fields
            if name in _FLAG_FIELDS or name in AdmissionSettings.model_fields
        }
        return _BlockSettings(**values)

    @classmethod
    def from_settings(cls, settings: AdmissionSettings) -> AdmissionPolicyBlock:
        settings_names = {v: k for k, v in _FLAG_FIELDS.items()}
        return cls(
            **{
                settings_names.get(name, name): getattr(settings, name)
                for name in AdmissionSettings.model_fields
                if settings_names.get(name, name) in cls.model_fields
            }
        )


class RuntimeHistoryBlock(_SlurmgateBlock):
    """Past runtimes per job key (job name with its matrix values, and its node count).

    The reconcile flow learns them from GitHub's `started_at`/`completed_at` of finished lease
    jobs and feeds them to the reservation policies as learned estimates. A block, because a
    Prefect Variable holds at most 5,000 characters and an artifact is for people, not reads;
    merging is a union keyed by job id, so two writers never diverge.

    Examples:
        ```python
        from slurmgate.blocks import RuntimeHistoryBlock
        block = RuntimeHistoryBlock.load("BLOCK_NAME")
        history = block.runtime_history()
        ```
    """

    _block_type_name = "slurmgate Runtime History"
    _block_type_slug = "slurmgate-runtime-history"

    history: dict[str, Any] = Field(
        default_factory=dict,
        description="The runtime history as JSON: format, keep, and per job key the runs.",
    )

    def runtime_history(self) -> RuntimeHistory:
        """The parsed history; raises HistoryError naming the bad field."""
        return RuntimeHistory.from_json(self.history)


__all__ = ["AdmissionPolicyBlock", "GitHubScopeBlock", "RuntimeHistoryBlock"]
