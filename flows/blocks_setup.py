"""Save the blocks the deployments load: register slurmgate's block types, save scope and policy.

`slurmgate init`, `slurmgate cordon` and `slurmgate uncordon` come here through the command
line's one door (`slurmgate/cli/prefect_layer`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
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


# How long a cordon waits for another edit of the same block before it gives up, and how long
# its hold lasts if its process dies mid-edit (Prefect's shortest lease; an edit takes < 1 s).
EDIT_WAIT_S = 60.0
EDIT_LEASE_S = 60.0


@asynccontextmanager
async def _editing(name: str) -> AsyncIterator[None]:
    """Hold the policy block `name` for one load-modify-save: Prefect saves a block whole, so
    two cordons at once would each save the block as they read it and one would be lost. The
    lock is a global concurrency limit of 1 on the Prefect server, shared by every host, held
    by a lease that the server takes back if this process dies."""
    lock = f"slurmgate-policy-block-{name}"
    deadline = time.monotonic() + EDIT_WAIT_S
    async with get_client() as client:
        await _one_slot_limit(client, lock)
        while True:
            try:
                answer = await client.increment_concurrency_slots_with_lease(
                    [lock], 1, "concurrency", lease_duration=EDIT_LEASE_S
                )
                break
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 423 or time.monotonic() > deadline:
                    raise
                wait = exc.response.headers.get("retry-after", "")
                await asyncio.sleep(min(float(wait) if _number(wait) else 0.2, 1.0))
        lease = UUID(answer.json()["lease_id"])
        try:
            yield
        finally:
            await client.release_concurrency_slots_with_lease(lease)


def _number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


async def _one_slot_limit(client: Any, lock: str) -> None:
    """The limit `lock` exists with one slot (created here the first time; two first edits at
    once may both try, and the server keeps one). Taking a slot of a missing limit succeeds
    and holds nothing, so its existence is checked, not assumed."""
    try:
        await client.read_global_concurrency_limit_by_name(lock)
        return
    except ObjectNotFound:
        pass
    with suppress(ObjectAlreadyExists, httpx.HTTPStatusError):
        await client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=lock, limit=1)
        )
    limit = await client.read_global_concurrency_limit_by_name(lock)
    if limit.limit != 1 or not limit.active:
        raise ValueError(
            f"the Prefect concurrency limit {lock!r} is not an active limit of 1; delete it "
            f"(prefect gcl delete {lock}) and cordon again"
        )


async def _set_cordon(name: str, pool: str, reason: str | None) -> dict[str, str]:
    async with _editing(name):
        return await _edit_cordons(name, pool, reason)


async def _edit_cordons(name: str, pool: str, reason: str | None) -> dict[str, str]:
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
