"""Save the blocks the deployments load: register slurmgate's block types, save scope and policy.

`slurmgate init` comes here through the command line's one door (`slurmgate/cli/prefect_layer`).
"""

from __future__ import annotations

from typing import Any

from prefect.settings import get_current_settings

from slurmgate.blocks import AdmissionPolicyBlock, GitHubScopeBlock, RuntimeHistoryBlock


def configured_prefect_api() -> tuple[str, str | None] | None:
    """The Prefect API the user configured (PREFECT_API_URL from the environment or the active
    profile) with its auth string, or None: flows would then run on a temporary server."""
    api = get_current_settings().api
    if not api.url:
        return None
    return api.url, api.auth_string.get_secret_value() if api.auth_string else None


def save_slurmgate_blocks(name: str, scope: dict[str, Any], policy: dict[str, Any]) -> None:
    """Register slurmgate's block types and save the scope and policy blocks as `name`
    (replacing blocks of that name), on the configured Prefect API."""
    for block_type in (GitHubScopeBlock, AdmissionPolicyBlock, RuntimeHistoryBlock):
        block_type.register_type_and_schema()
    GitHubScopeBlock(**scope).save(name, overwrite=True)
    AdmissionPolicyBlock(**policy).save(name, overwrite=True)
