"""Readiness: poll lane heads and endpoints until ready or a deadline, through a prober."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from slurmgate.errors import ExternalError

MAX_TEXT_CHARS = 1024 * 1024  # a fetched document (e.g. an endpoint's /metrics) is cut here
MODELS_PATH = "/v1/models"
MAX_MODELS_BYTES = 1024 * 1024  # a /v1/models page longer than this lists nothing we trust

# One GET of a probe chain: a URL that must answer 200, or {"url": URL, "lists": MODEL}, a
# /v1/models URL whose `data` must list MODEL ("" = any model). Plain JSON: it crosses to the
# probe step.
ProbeItem = str | dict[str, str]


class ReadinessTimeout(ExternalError):
    """Some targets were not ready by their deadline."""


@dataclass
class Target:
    """One URL that must answer 200 on `path` (and on /v1/models when `models` is set).

    With `lists_model` set, /v1/models must also list that model ("" = any model): an engine
    whose /health answers before the model is served is not ready yet (the engine profile
    decides, `engines.Probes`). It is ready after `needed` good probes in a row: /health flaps
    while a server starts, and a single good answer has admitted lanes that were still loading.
    """

    name: str
    base_url: str
    path: str = "/health"
    deadline: float = 0.0  # time.monotonic()
    models: bool = True
    lists_model: str | None = None
    needed: int = 1
    # A rule over the JSON of the readiness answer (a frontend must list its workers, etcd
    # must say it is healthy): such a target is fetched, not probed, and judged by it.
    accept: Callable[[Any], bool] | None = None
    ready: bool = False
    streak: int = 0
    last: str = "not probed"

    def record(self, good: bool) -> None:
        """Count one probe; a bad one restarts the streak."""
        self.streak = self.streak + 1 if good else 0
        self.ready = self.streak >= self.needed
        if good and not self.ready:
            self.last = f"ready {self.streak}/{self.needed} probes in a row"

    def urls(self) -> list[ProbeItem]:
        """What one probe GETs, in order: the readiness path, then /v1/models if asked."""
        items: list[ProbeItem] = [self.base_url + self.path]
        if self.models:
            models = self.base_url + MODELS_PATH
            items.append(
                models if self.lists_model is None else {"url": models, "lists": self.lists_model}
            )
        return items


def probe_item(item: Any) -> tuple[str, str | None] | None:
    """(url, model to find) of a chain item; None when it is neither form."""
    if isinstance(item, str):
        return item, None
    if (
        isinstance(item, dict)
        and set(item) == {"url", "lists"}
        and isinstance(item["url"], str)
        and isinstance(item["lists"], str)
    ):
        return item["url"], item["lists"]
    return None


def listed_models(body: bytes) -> list[str] | None:
    """The model ids of an OpenAI-style /v1/models answer; None when it is not one."""
    if len(body) > MAX_MODELS_BYTES:
        return None
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def probe_chain(
    client: httpx.Client, items: Sequence[ProbeItem], timeout: float
) -> tuple[bool, str]:
    """GET each URL in order until one is not 200 (or does not list its model); (ready, why)."""
    for item in items:
        parsed = probe_item(item)
        if parsed is None:
            return False, "malformed probe item"
        url, model = parsed
        path = "/" + url.split("://", 1)[-1].partition("/")[2]
        try:
            r = client.get(url, timeout=timeout)
        except httpx.HTTPError as exc:
            return False, f"{path}: {type(exc).__name__}"
        if r.status_code != 200:
            return False, f"{path}: HTTP {r.status_code}"
        if model is not None:
            ids = listed_models(r.content)
            if ids is None:
                return False, f"{path}: not a model list"
            if not ids or (model and model not in ids):
                wanted = repr(model)[:100] if model else "a model"
                return False, f"{path}: does not list {wanted} yet"
    return True, "ready"


class Prober(Protocol):
    """Runs probes somewhere: in this process, or in a step on the client host."""

    def probe(self, chains: list[list[ProbeItem]], timeout: float) -> list[tuple[bool, str]]: ...

    def fetch(self, url: str, headers: dict[str, str], timeout: float) -> str | None: ...


class LocalProber:
    """Probes from this process (when it runs where the endpoints and the client run)."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def probe(self, chains: list[list[ProbeItem]], timeout: float) -> list[tuple[bool, str]]:
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
        pending = [t for t in targets if not t.ready and t.accept is None]
        answers = prober.probe([t.urls() for t in pending], probe_timeout) if pending else []
        for t, (ok, why) in zip(pending, answers, strict=True):
            t.last = why
            t.record(ok)
        for t in targets:
            if not t.ready and t.accept is not None:
                ok, t.last = judge(prober, t, probe_timeout)
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


def judge(prober: Prober, target: Target, timeout: float) -> tuple[bool, str]:
    """Fetch a target's readiness answer and judge its JSON by the target's rule."""
    assert target.accept is not None
    text = prober.fetch(target.base_url + target.path, {}, timeout)
    if text is None:
        return False, f"{target.path}: no 200 answer"
    try:
        body = json.loads(text)
    except ValueError:
        return False, f"{target.path}: not JSON"
    if not target.accept(body):
        return False, f"{target.path}: {text[:200]}"
    return True, "ready"


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
