"""Readiness probes: poll lane heads and endpoints from the controller until ready or a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from slurmgate.errors import ExternalError


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


def probe(client: httpx.Client, target: Target, timeout: float) -> bool:
    """One bounded probe; records why it failed in target.last."""
    paths = [target.path] + (["/v1/models"] if target.models else [])
    for path in paths:
        try:
            r = client.get(target.base_url + path, timeout=timeout)
        except httpx.HTTPError as exc:
            target.last = f"{path}: {type(exc).__name__}"
            return False
        if r.status_code != 200:
            target.last = f"{path}: HTTP {r.status_code}"
            return False
    target.last = "ready"
    return True


def wait_ready(
    targets: Sequence[Target],
    *,
    probe_timeout: float = 1.0,
    poll_s: float = 0.2,
    check_alive: Callable[[], None] = lambda: None,
    on_progress: Callable[[int, int], None] | None = None,
) -> float:
    """Poll until every target is ready; `check_alive` raises to fail at once. Returns seconds."""
    t0 = time.monotonic()
    ready_count = -1
    with httpx.Client(trust_env=False) as client:
        while True:
            check_alive()
            for t in targets:
                if not t.ready:
                    t.record(probe(client, t, probe_timeout))
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


def fetch_text(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> str | None:
    """GET a small text document (e.g. /metrics); None when unreachable."""
    try:
        r = httpx.get(url, timeout=timeout, trust_env=False, headers=headers)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None
