"""Fixtures for the relay tests: the session's real Prefect server, a relay, signed deliveries."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Events reach the database in the persister's batches (every 5 s by default); the relay tests
# read events back, so a test server started after this line flushes twice a second.
os.environ.setdefault("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL", "0.5")


@pytest.fixture(scope="session")
def prefect_api(prefect_harness: None) -> str:
    """The API URL of the session's Prefect test server."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url, "the Prefect test harness did not set PREFECT_API_URL"
    return str(url).rstrip("/")


@pytest.fixture
def relay_factory(prefect_api: str) -> Iterator[Callable[..., Any]]:
    """`relay_factory(**settings)` -> a running RelayServer posting to the test server."""
    from relaykit import SECRET

    from slurmgate.github.webhook import RelayServer, RelaySettings

    started: list[Any] = []

    def start(**overrides: Any) -> Any:
        options: dict[str, Any] = {"secret": SECRET, "prefect_api_url": prefect_api}
        options.update(overrides)
        server = RelayServer(RelaySettings(**options)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
