"""Readiness: poll lane heads and endpoints until ready or a deadline, through a prober."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from slurmgate.errors import ExternalError

MAX_TEXT_CHARS = 1024 * 1024  # a fetched document (e.g. an endpoint's /metrics) is cut here


class ReadinessTimeout(ExternalError):
    """Some targets were not ready by their deadline."""


@dataclass
class Target:
    """One URL that must answer 200 on `path` (and on /v1/models when `models` is set).

    It is ready after `needed` good probes in a row: /health flaps while a server starts, and a
    single good answer has admitted lanes that were still loading (see runtime-anchors).
    """

    name: str
    base_url: str
    path: str = "/health"
    deadline: float = 0.0  # time.monotonic()
    models: bool = True
    needed: int = 1
    ready: bool = False
    streak: int = 0
    last: str = "not probed"

    def record(self, good: bool) -> None:
        """Count one probe; a bad one restarts the streak."""
        self.streak = self.streak + 1 if good else 0
        self.ready = self.streak >= self.needed
        if good and not self.ready:
            self.last = f"ready {self.streak}/{self.needed} probes in a row"

    def urls(self) -> list[str]:
        """What one probe GETs, in order: the readiness path, then /v1/models if asked."""
        paths = [self.path] + (["/v1/models"] if self.models else [])
        return [self.base_url + p for p in paths]


def probe_chain(client: httpx.Client, urls: Sequence[str], timeout: float) -> tuple[bool, str]:
    """GET each URL in order until one is not 200; (ready, why)."""
    for url in urls:
        path = "/" + url.split("://", 1)[-1].partition("/")[2]
        try:
            r = client.get(url, timeout=timeout)
        except httpx.HTTPError as exc:
            return False, f"{path}: {type(exc).__name__}"
        if r.status_code != 200:
            return False, f"{path}: HTTP {r.status_code}"
    return True, "ready"


class Prober(Protocol):
    """Runs probes somewhere: in this process, or in a step on the client host."""

    def probe(self, chains: list[list[str]], timeout: float) -> list[tuple[bool, str]]: ...

    def fetch(self, url: str, headers: dict[str, str], timeout: float) -> str | None: ...


class LocalProber:
    """Probes from this process (when it runs where the endpoints and the client run)."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def probe(self, chains: list[list[str]], timeout: float) -> list[tuple[bool, str]]:
        return [probe_chain(self.client, chain, timeout) for chain in chains]

    def fetch(self, url: str, headers: dict[str, str], timeout: float) -> str | None:
        return fetch_text(url, timeout, headers, client=self.client)


def wait_ready(
    targets: Sequence[Target],
    *,
    probe_timeout: float = 1.0,
    poll_s: float = 0.2,
    check_alive: Callable[[], None] = lambda: None,
    on_progress: Callable[[int, int], None] | None = None,
    prober: Prober | None = None,
) -> float:
    """Poll until every target is ready; `check_alive` raises to fail at once. Returns seconds.

    Without a `prober` the probes run in this process.
    """
    if prober is None:
        with httpx.Client(trust_env=False) as client:
            return wait_ready(
                targets,
                probe_timeout=probe_timeout,
                poll_s=poll_s,
                check_alive=check_alive,
                on_progress=on_progress,
                prober=LocalProber(client),
            )
    t0 = time.monotonic()
    ready_count = -1
    while True:
        check_alive()
        pending = [t for t in targets if not t.ready]
        answers = prober.probe([t.urls() for t in pending], probe_timeout) if pending else []
        for t, (ok, why) in zip(pending, answers, strict=True):
            t.last = why
            t.record(ok)
        now_ready = sum(t.ready for t in targets)
        if now_ready != ready_count:
            ready_count = now_ready
            if on_progress is not None:
                on_progress(now_ready, len(targets))
        if now_ready == len(targets):
            return time.monotonic() - t0
        now = time.monotonic()
        late = [t for t in targets if not t.ready and now >= t.deadline]
        if late:
            detail = "; ".join(f"{t.name} at {t.base_url} ({t.last})" for t in late)
            raise ReadinessTimeout(f"not ready by the startup deadline: {detail}")
        time.sleep(poll_s)


def fetch_text(
    url: str,
    timeout: float = 2.0,
    headers: dict[str, str] | None = None,
    *,
    client: httpx.Client | None = None,
    limit: int = MAX_TEXT_CHARS,
) -> str | None:
    """GET a small text document (e.g. /metrics), cut to `limit`; None when unreachable."""
    try:
        if client is None:
            r = httpx.get(url, timeout=timeout, trust_env=False, headers=headers)
        else:
            r = client.get(url, timeout=timeout, headers=headers)
    except httpx.HTTPError:
        return None
    return r.text[:limit] if r.status_code == 200 else None
