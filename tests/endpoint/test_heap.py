"""The endpoint's process freezes its start-up heap, so no full collection walks it on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from endpoint_helpers import Backend, running_backends, until

from slurmgate.runtime.endpoint import app
from slurmgate.runtime.endpoint.config import parse_config


async def listening(port: int) -> None:
    """Until the endpoint accepts connections on ``port``."""

    async def accepts() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        return True

    for _ in range(200):
        if await accepts():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


@pytest.fixture
def unfrozen() -> Any:
    """This process's heap unfrozen before the test and after it (a frozen object's cycles
    are never collected)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@contextlib.asynccontextmanager
async def serving(backend: str, **options: Any) -> AsyncIterator[tuple[str, Any]]:
    """`app.serve` on a bound socket, in front of `backend`: its URL and its config."""
    config = parse_config(["--name", "t", "--listen", "127.0.0.1:0", "--backend", backend])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    task = asyncio.create_task(app.serve(config, sock, **options))
    try:
        yield f"http://127.0.0.1:{port}", config
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()


async def test_serve_freezes_the_heap_once_it_listens(unfrozen: Any) -> None:
    a = Backend("a")
    async with (
        running_backends(a) as urls,
        httpx.AsyncClient(timeout=10) as client,
        serving(urls[0], freeze_heap=True) as (url, config),
    ):
        await until(lambda: gc.get_freeze_count() > 0, timeout=10)
        # what was alive at start-up is out of the collector's generations
        assert not any(o is config for o in gc.get_objects())
        answer = await client.post(f"{url}/v1/completions", json={})
        assert answer.status_code == 200 and a.hits == 1


async def test_serve_leaves_the_heap_alone_unless_asked(unfrozen: Any) -> None:
    a = Backend("a")
    async with (
        running_backends(a) as urls,
        httpx.AsyncClient(timeout=10) as client,
        serving(urls[0]) as (url, _),
    ):
        await listening(int(url.rsplit(":", 1)[1]))
        answer = await client.post(f"{url}/v1/completions", json={})
        assert answer.status_code == 200
        assert gc.get_freeze_count() == 0


def test_the_endpoint_process_serves_with_its_heap_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m slurmgate.runtime.endpoint`` and ``slurmgate endpoint`` both go through main."""
    seen: dict[str, Any] = {}

    async def fake_serve(config: Any, sock: Any = None, freeze_heap: bool = False) -> None:
        seen["freeze_heap"] = freeze_heap

    monkeypatch.setattr(app, "serve", fake_serve)
    app.main(["--name", "t", "--listen", "127.0.0.1:0", "--backend", "http://127.0.0.1:9"])
    assert seen == {"freeze_heap": True}
