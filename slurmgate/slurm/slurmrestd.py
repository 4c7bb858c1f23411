"""Slurm's nodes, reservations and node-holding jobs read from slurmrestd, for the capacity read.

Where a site serves Slurm's REST API, the tick's capacity read can ask it instead of running
`scontrol` and `squeue` (`SLURMGATE_SLURMRESTD_URL`): three GETs, `/slurm/<version>/nodes`,
`/reservations` and `/jobs`, read into the same nodes, reservations and jobs the commands give,
so the capacity rules (`slurm_capacity.node_capacity`) are the same either way.

- `http://host:6820` or `https://...`: slurmrestd with `auth/jwt`; the request carries
  `X-SLURM-USER-NAME` ($SLURMGATE_SLURMRESTD_USER) and `X-SLURM-USER-TOKEN`
  ($SLURMGATE_SLURMRESTD_TOKEN, e.g. from `scontrol token lifespan=...`).
- `unix:/path/to/socket`: slurmrestd with `rest_auth/local`, which trusts the socket's peer.

The shapes parsed are those of the OpenAPI plugins from v0.0.38 (Slurm 22.05) on: a state as a
lower-case string with `state_flags`, or (later plugins) as a list of upper-case words; a time as
epoch seconds, or as `{"set": ..., "infinite": ..., "number": ...}`. A failure is a `SlurmError`,
so the tick fails open on it as on the commands. The token is never in a message.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import ValidationError

from slurmgate.admission.capacity import NodeCapacity
from slurmgate.errors import InputError
from slurmgate.settings.admission import PoolPartition
from slurmgate.settings.slurm import SlurmRestSettings
from slurmgate.slurm.capacity import (
    SlurmJob,
    SlurmNode,
    SlurmReservation,
    expand_hostlist,
    pool_capacity,
)
from slurmgate.slurm.commands import SlurmError

# Jobs whose allocation holds nodes, as `squeue -t` lists them for the command read.
HOLDING_STATES = frozenset(
    {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"}
)
MAX_BODY_BYTES = 64 * 1024 * 1024


class SlurmRestConfigError(InputError):
    """SLURMGATE_SLURMRESTD_* that cannot work; one line naming the variable and the fix."""


def rest_settings() -> SlurmRestSettings:
    """The environment's slurmrestd settings, or SlurmRestConfigError (never showing the token)."""
    try:
        return SlurmRestSettings()
    except ValidationError as exc:
        lines = []
        for error in exc.errors(include_input=False):
            said = str(error["msg"]).removeprefix("Value error, ")
            name = f"SLURMGATE_SLURMRESTD_{str(error['loc'][0]).upper()}" if error["loc"] else ""
            lines.append(said if said.startswith("SLURMGATE_") else f"{name}: {said}")
        raise SlurmRestConfigError("; ".join(lines)) from None


def _words(value: Any) -> list[str]:
    """A state or a flag list as upper-case words, whether Slurm sent a string or a list."""
    if isinstance(value, str):
        return [value.upper()] if value else []
    if isinstance(value, list):
        return [str(v).upper() for v in value if isinstance(v, str) and v]
    return []


def _names(value: Any) -> frozenset[str]:
    """Partitions or features: a comma-separated string or a list of strings."""
    if isinstance(value, str):
        return frozenset(x for x in value.split(",") if x and value != "(null)")
    if isinstance(value, list):
        return frozenset(x for x in value if isinstance(x, str) and x)
    return frozenset()


def _epoch(value: Any) -> float | None:
    """Epoch seconds from an integer or a `{"set", "infinite", "number"}` object; None for no
    time Slurm can promise (unset, infinite, 0)."""
    if isinstance(value, dict):
        if value.get("infinite") or value.get("set") is False:
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # later plugins split a job's comment by who wrote it
        return " ".join(str(v) for v in value.values() if isinstance(v, str))
    return ""


def parse_rest_nodes(body: Any) -> list[SlurmNode]:
    nodes = []
    for item in _items(body, "nodes"):
        name = item.get("name")
        if not isinstance(name, str) or not name:
            continue
        state = _words(item.get("state"))
        flags = set(state[1:]) | set(_words(item.get("state_flags")))
        nodes.append(
            SlurmNode(
                name=name,
                base=state[0] if state else "UNKNOWN",
                flags=frozenset(flags),
                partitions=_names(item.get("partitions")),
                features=_names(item.get("features")),
            )
        )
    return nodes


def parse_rest_reservations(body: Any, now: float) -> list[SlurmReservation]:
    """The reservations active at `now` (one that has not started holds nothing yet)."""
    found = []
    for item in _items(body, "reservations"):
        name, nodes = item.get("name"), item.get("node_list")
        if not isinstance(name, str) or not name:
            continue
        start, end = _epoch(item.get("start_time")), _epoch(item.get("end_time"))
        if (start is not None and start > now) or (end is not None and end <= now):
            continue
        found.append(
            SlurmReservation(
                name=name,
                nodes=frozenset(expand_hostlist(nodes)) if isinstance(nodes, str) else frozenset(),
                end_s=end,
            )
        )
    return found


def parse_rest_jobs(body: Any) -> list[SlurmJob]:
    """The jobs whose allocation holds nodes."""
    jobs = []
    for item in _items(body, "jobs"):
        if not HOLDING_STATES.intersection(_words(item.get("job_state"))):
            continue
        nodes = item.get("nodes")
        jobs.append(
            SlurmJob(
                job_id=str(item.get("job_id", "")),
                name=_text(item.get("name")),
                comment=_text(item.get("comment")),
                nodes=tuple(expand_hostlist(nodes)) if isinstance(nodes, str) and nodes else (),
                end_s=_epoch(item.get("end_time")),
            )
        )
    return jobs


def _items(body: Any, key: str) -> list[dict[str, Any]]:
    listed = body.get(key) if isinstance(body, dict) else None
    if not isinstance(listed, list):
        return []
    return [item for item in listed if isinstance(item, dict)]


def _client(settings: SlurmRestSettings) -> httpx.Client:
    url = settings.url or ""
    headers = {"Accept": "application/json"}
    if settings.user:
        headers["X-SLURM-USER-NAME"] = settings.user
    if settings.token is not None:
        headers["X-SLURM-USER-TOKEN"] = settings.token.get_secret_value()
    if url.startswith("unix:"):
        transport = httpx.HTTPTransport(uds=url.removeprefix("unix:"))
        return httpx.Client(
            base_url="http://slurmrestd",
            transport=transport,
            headers=headers,
            timeout=settings.timeout_s,
        )
    return httpx.Client(
        base_url=url, headers=headers, timeout=settings.timeout_s, follow_redirects=False
    )


def _get(http: httpx.Client, path: str, settings: SlurmRestSettings) -> Any:
    """One GET; any failure is a SlurmError naming the request (raised outside the `except`,
    so no httpx object, which holds the token header, is chained)."""
    argv = ["slurmrestd", "GET", f"{settings.url}{path}"]
    failure: str | None = None
    try:
        response = http.get(path)
    except httpx.HTTPError as exc:
        failure = type(exc).__name__
    if failure is not None:
        raise SlurmError(argv, f"failed ({failure}); check that slurmrestd serves it")
    if response.status_code != 200:
        said = " ".join(response.text[:200].split())
        raise SlurmError(
            argv,
            f"answered {response.status_code}; check SLURMGATE_SLURMRESTD_USER and _TOKEN "
            f"(auth/jwt) or the socket's owner (rest_auth/local)",
            said,
        )
    if len(response.content) > MAX_BODY_BYTES:
        raise SlurmError(argv, f"answered more than {MAX_BODY_BYTES} bytes")
    try:
        body = response.json()
    except ValueError:
        body = None
    errors = body.get("errors") if isinstance(body, dict) else None
    if not isinstance(body, dict) or errors:
        said = "; ".join(
            str(e.get("error") or e.get("description") or e)[:120]
            for e in (errors or [])
            if isinstance(e, dict)
        )
        raise SlurmError(argv, "answered without its listing", said)
    return body


def read_rest_capacity(
    settings: SlurmRestSettings, partitions: Mapping[str, PoolPartition]
) -> dict[str, NodeCapacity]:
    """`slurm_capacity.read_pool_capacity`, read from slurmrestd."""
    if not partitions:
        return {}
    base = f"/slurm/{settings.api_version}"
    with _client(settings) as http:
        nodes = parse_rest_nodes(_get(http, f"{base}/nodes", settings))
        reservations = parse_rest_reservations(
            _get(http, f"{base}/reservations", settings), time.time()
        )
        jobs = parse_rest_jobs(_get(http, f"{base}/jobs", settings))
    if not nodes:
        raise SlurmError(["slurmrestd", "GET", f"{settings.url}{base}/nodes"], "listed no nodes")
    return pool_capacity(partitions, nodes, reservations, jobs)
