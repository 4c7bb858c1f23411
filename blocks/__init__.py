"""Prefect blocks for slurmgate: the GitHub scope with its token, and the admission policy."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator, model_validator

from slurmgate.settings import AdmissionSettings

_REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_ORG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")


class GitHubScopeBlock(Block):
    """Where slurmgate reads runners and jobs: a GitHub API, a repository or org, a token.

    The token is a secret: it is masked in the UI and API, and never logged.

    Examples:
        ```python
        from blocks import GitHubScopeBlock
        GitHubScopeBlock(repo="acme/bench", token="ghp_...").save("acme-bench")
        scope = GitHubScopeBlock.load("acme-bench")
        ```
    """

    _block_type_name = "slurmgate GitHub Scope"
    _block_type_slug = "slurmgate-github-scope"
    _documentation_url = "https://github.com/slurmgate/slurmgate#blocks"  # type: ignore[assignment]

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
    token: SecretStr = Field(
        description="GitHub token with admin rights on the repository's or org's runners.",
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

    @field_validator("api_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"api_url {value!r} must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("repo")
    @classmethod
    def _repo_shape(cls, value: str | None) -> str | None:
        if value is not None and not _REPO_RE.match(value):
            raise ValueError(f"repo {value!r} must be OWNER/NAME, e.g. acme/bench")
        return value

    @field_validator("org")
    @classmethod
    def _org_shape(cls, value: str | None) -> str | None:
        if value is not None and not _ORG_RE.match(value):
            raise ValueError(f"org {value!r} must be a GitHub organization login, e.g. acme")
        return value

    @model_validator(mode="after")
    def _one_scope(self) -> GitHubScopeBlock:
        if (self.repo is None) == (self.org is None):
            raise ValueError("set exactly one of repo (OWNER/NAME) or org (NAME) on the scope")
        return self

    @property
    def scope_name(self) -> str:
        """`repo:OWNER/NAME` or `org:NAME`, for logs and state file names."""
        return f"repo:{self.repo}" if self.repo else f"org:{self.org}"

    def get_client(self, **kwargs: Any) -> Any:
        """A `slurmgate.github.GitHubClient` for this scope; use it as an async context manager."""
        from tasks.github import client_for_scope

        return client_for_scope(self, **kwargs)


class AdmissionPolicyBlock(Block):
    """The admission policy: the two feature flags and the planner knobs (as AdmissionSettings).

    Examples:
        ```python
        from blocks import AdmissionPolicyBlock
        AdmissionPolicyBlock(priority_scheduler_enabled=True,
                             node_slot_scheduler_enabled=True).save("default")
        ```
    """

    _block_type_name = "slurmgate Admission Policy"
    _block_type_slug = "slurmgate-admission-policy"
    _documentation_url = "https://github.com/slurmgate/slurmgate#blocks"  # type: ignore[assignment]

    priority_scheduler_enabled: bool = Field(
        default=False,
        description="Admit queued jobs by weighted runner leases in priority order.",
    )
    node_slot_scheduler_enabled: bool = Field(
        default=False,
        description="Size each job by its nodes:N label (needs the priority scheduler).",
    )
    policy: Literal["greedy"] = Field(
        default="greedy", description="Ordering and fit policy of the planner."
    )
    lease_max_queued_age_s: float = Field(
        default=3600.0,
        gt=0,
        description="Release a lease older than this (seconds) while its job is still queued.",
    )
    orphan_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="Leave an anchorless lease younger than this (seconds) alone.",
    )
    default_priority: Decimal = Field(
        default=Decimal("1.000"),
        description="Score of a job without a ci-job-<score>-<token> label.",
    )

    def to_settings(self) -> AdmissionSettings:
        """The planner settings this block describes; raises naming the field on bad input."""
        return AdmissionSettings(
            PRIORITY_SCHEDULER_ENABLED=self.priority_scheduler_enabled,
            NODE_SLOT_SCHEDULER_ENABLED=self.node_slot_scheduler_enabled,
            policy=self.policy,
            lease_max_queued_age_s=self.lease_max_queued_age_s,
            orphan_grace_s=self.orphan_grace_s,
            default_priority=self.default_priority,
        )

    @classmethod
    def from_settings(cls, settings: AdmissionSettings) -> AdmissionPolicyBlock:
        return cls(
            priority_scheduler_enabled=settings.PRIORITY_SCHEDULER_ENABLED,
            node_slot_scheduler_enabled=settings.NODE_SLOT_SCHEDULER_ENABLED,
            policy=settings.policy,
            lease_max_queued_age_s=settings.lease_max_queued_age_s,
            orphan_grace_s=settings.orphan_grace_s,
            default_priority=settings.default_priority,
        )


__all__ = ["AdmissionPolicyBlock", "GitHubScopeBlock"]
