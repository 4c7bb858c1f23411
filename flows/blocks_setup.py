"""Save the blocks the deployments load: register slurmgate's block types, save scope and policy.

`slurmgate init`, `slurmgate cordon` and `slurmgate uncordon` come here through the command
line's one door (`slurmgate/cli/prefect_layer`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from prefect.settings import get_current_settings

from slurmgate.blocks import AdmissionPolicyBlock, GitHubScopeBlock, RuntimeHistoryBlock
from slurmgate.settings.admission import pool_key


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


def set_cordon(name: str, pool: str, reason: str | None) -> dict[str, str]:
    """Cordon `pool` (with `reason`) in the saved policy block `name`, or reopen it (`reason`
    None), and save the block; returns its cordoned pools as saved. Raises ValueError naming
    the fix when no such block exists, or the pool name is not one."""
    return asyncio.run(_set_cordon(name, pool, reason))


async def _set_cordon(name: str, pool: str, reason: str | None) -> dict[str, str]:
    try:
        block: AdmissionPolicyBlock = await AdmissionPolicyBlock.aload(name)
    except ValueError:
        raise ValueError(
            f"no slurmgate-admission-policy block named {name!r} on this Prefect API; save it "
            f"with `slurmgate init --name {name}` first (the deployments load `default`)"
        ) from None
    cordons = dict(block.cordoned_pools)
    key = pool_key(pool, "cordoned_pools")
    if reason is None:
        cordons.pop(key, None)
    else:
        cordons[key] = reason
    fields = {**block.model_dump(exclude={"cordoned_pools"}), "cordoned_pools": cordons}
    await AdmissionPolicyBlock(**fields).asave(name, overwrite=True)  # validated as the form is
    saved: AdmissionPolicyBlock = await AdmissionPolicyBlock.aload(name)
    return saved.cordoned_pools
