"""A GitHubClient for a scope, with its ETag cache in a file that outlives the process."""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import SecretStr

from slurmgate.github.app_auth import GitHubAppCredentials
from slurmgate.github.client import GitHubClient
from slurmgate.github.etags import FileEtagCache
from slurmgate.github.scope import GitHubScope
from slurmgate.paths import state_dir


def etag_cache_for(scope: GitHubScope) -> FileEtagCache:
    """One ETag cache file per API and scope, so 304s survive across flow runs and processes."""
    key = hashlib.sha256(f"{scope.api_url}|{scope.repo}|{scope.org}".encode()).hexdigest()[:16]
    return FileEtagCache(state_dir() / f"etags-{key}.json")


def client_for_scope(
    scope: GitHubScope, token: str | SecretStr | GitHubAppCredentials, **options: Any
) -> GitHubClient:
    """A client for `scope` with its file ETag cache (kept across processes); `options` go to
    GitHubClient, e.g. min_write_interval_s and max_retries."""
    options.setdefault("etag_cache", etag_cache_for(scope))
    return GitHubClient(scope, token, **options)
