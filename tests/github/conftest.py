"""Fixtures for the GitHub client and emulator tests: a live emulator, clients, a spec validator."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest, MockResponse

from slurmgate.github.client import GitHubClient
from slurmgate.github.etags import EtagCache
from slurmgate.github.scope import GitHubScope
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

SPEC_PATH = Path(__file__).resolve().parents[1] / "data" / "runners-subset.json"


def _allow_null_in_nullable_enums(node: Any) -> None:
    """OAS 3.0.3: `nullable: true` admits null, but strict validators also demand null in `enum`.

    GitHub returns `conclusion: null` for unfinished jobs (schema: nullable enum), so the
    validator is told what the schema means. Nothing else in the spec is touched.
    """
    if isinstance(node, dict):
        enum = node.get("enum")
        if node.get("nullable") is True and isinstance(enum, list) and None not in enum:
            node["enum"] = [*enum, None]
        for value in node.values():
            _allow_null_in_nullable_enums(value)
    elif isinstance(node, list):
        for value in node:
            _allow_null_in_nullable_enums(value)


@pytest.fixture(scope="session")
def openapi() -> OpenAPI:
    spec = json.loads(SPEC_PATH.read_text())
    _allow_null_in_nullable_enums(spec)
    return OpenAPI.from_dict(spec)


@pytest.fixture(scope="session")
def validate(openapi: OpenAPI) -> Callable[[httpx.Response], None]:
    """Validate one real emulator response against GitHub's OpenAPI description."""

    def check(response: httpx.Response) -> None:
        request = response.request
        mock_request = MockRequest(
            "https://api.github.com",
            request.method.lower(),
            request.url.path,
            args=dict(request.url.params),
            headers=dict(request.headers),
            data=request.content or None,
        )
        mock_response = MockResponse(
            data=response.content,
            status_code=response.status_code,
            headers=dict(response.headers),
            content_type=response.headers.get("content-type", "application/json"),
        )
        openapi.validate_response(mock_request, mock_response)

    return check


@pytest.fixture
def emu() -> Iterator[RunningEmulator]:
    """A fresh emulator: pool h100 (4 runners), pool b200 (3 runners), 2 legacy runners."""
    with running_emulator(pools={"h100": 4, "b200": 3}, legacy=2) as running:
        yield running


@pytest.fixture
def api(emu: RunningEmulator) -> Iterator[httpx.Client]:
    """A raw HTTP client on the emulator, authenticated, for shape and status checks."""
    with httpx.Client(
        base_url=emu.url, headers={"Authorization": f"Bearer {emu.token}"}, timeout=10
    ) as client:
        yield client


MakeClient = Callable[..., GitHubClient]


@pytest.fixture
async def make_client(emu: RunningEmulator) -> AsyncIterator[MakeClient]:
    """Build GitHubClients on the emulator with test-sized backoff; all closed afterwards."""
    made: list[GitHubClient] = []

    def make(
        *, etag_cache: EtagCache | None = None, token: str | None = None, **kwargs: Any
    ) -> GitHubClient:
        options: dict[str, Any] = {
            "backoff_base_s": 0.01,
            "backoff_cap_s": 0.05,
            "secondary_wait_s": 0.05,
            "max_retries": 4,
            "timeout_s": 5.0,
        }
        options.update(kwargs)
        client = GitHubClient(
            GitHubScope(api_url=emu.url, repo=emu.repo),
            token or emu.token,
            etag_cache=etag_cache,
            **options,
        )
        made.append(client)
        return client

    yield make
    for client in made:
        await client.aclose()
