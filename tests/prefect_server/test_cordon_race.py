"""Cordons edit the saved policy block one at a time: concurrent ones are all kept."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from slurmgate.blocks import AdmissionPolicyBlock
from slurmgate.flows import blocks_setup

from .conftest import PrefectServer

pytestmark = pytest.mark.prefect_server

POOLS = [f"race{n}" for n in range(4)]


def test_concurrent_cordons_of_one_block_are_all_kept(
    prefect_server: PrefectServer, saved_blocks: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    load = AdmissionPolicyBlock.aload

    async def slow_load(name: str, *args: Any, **kwargs: Any) -> Any:
        # every editor reads the block before any has saved: without the lock, each save
        # would carry only its own pool and the last one would win
        block = await load(name, *args, **kwargs)
        await blocks_setup.asyncio.sleep(0.5)
        return block

    monkeypatch.setattr(AdmissionPolicyBlock, "aload", slow_load)
    errors: list[BaseException] = []

    def cordon(pool: str) -> None:
        try:
            with prefect_server.client_settings():  # settings are per thread (contextvars)
                blocks_setup.set_cordon("default", pool, f"swap {pool}")
        except BaseException as exc:
            errors.append(exc)

    with prefect_server.client_settings():
        try:
            threads = [threading.Thread(target=cordon, args=(pool,)) for pool in POOLS]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert errors == []
            monkeypatch.setattr(AdmissionPolicyBlock, "aload", load)
            saved = blocks_setup.set_cordon("default", POOLS[0], None)
            assert sorted(saved) == [f"cluster:{p}" for p in POOLS[1:]]
        finally:
            monkeypatch.setattr(AdmissionPolicyBlock, "aload", load)
            for pool in POOLS:
                blocks_setup.set_cordon("default", pool, None)
