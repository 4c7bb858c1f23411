"""Slurm's nodes per pool: which nodes of a pool's partition can run a managed job now, and why not.

The admission core declares what it needs (`admission.capacity.NodeCapacity`); this adapter
fills it from three short reads per tick: `scontrol show node -o`, `scontrol show reservation
-o` and `squeue` of the jobs holding nodes. A node cannot take a managed job when it is DOWN,
NOT_RESPONDING, FAIL(ING), DRAIN (drained, or draining while its jobs end), MAINT, powered down
or rebooting, in an active reservation other than the pool's (or, when the pool names a
reservation, outside it), or allocated to a job outside the managed path.

Managed jobs are recognised by name: the allocation runtime names its `salloc` `sg-<spec
name>-<hex>` (`runtime/run.new_run_id`), which the example workflow's `slurmgate allocation run`
uses; a job whose comment contains `slurmgate` counts too (for a site's own wrapper). Their
nodes are not missing: the leases of their jobs already count them.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from slurmgate.admission.capacity import MissingNodes, NodeCapacity
from slurmgate.settings.admission import PoolPartition
from slurmgate.slurm import commands as slurm
from slurmgate.slurm.jobenv import command_environment

MANAGED_JOB_PREFIX = "sg-"
MANAGED_COMMENT = "slurmgate"
_SEP = "\x1f"  # squeue's field separator: job names and comments may hold any printable text
_SQUEUE_FORMAT = _SEP.join(("%i", "%e", "%N", "%j", "%k"))
# Jobs that hold nodes (PENDING ones do not).
_HOLDING = "RUNNING,COMPLETING,CONFIGURING,SUSPENDED,STOPPED,SIGNALING,STAGE_OUT"
_BUSY_BASES = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
_POWER_FLAGS = frozenset(
    {
        "POWERED_DOWN",
        "POWER_DOWN",
        "POWERING_DOWN",
        "POWERING_UP",
        "REBOOT_REQUESTED",
        "REBOOT_ISSUED",
    }
)
HELD_OUTSIDE = "held by jobs outside slurmgate"


def is_managed_job(name: str, comment: str = "") -> bool:
    """A job of the managed path: named `sg-...` by the runtime, or commented `slurmgate`."""
    return name.startswith(MANAGED_JOB_PREFIX) or MANAGED_COMMENT in comment.casefold()


# ---- node lists ------------------------------------------------------------------------------

_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<suffix>[^\[\]]*)$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact node list expanded: `node[1-3,7],gpu[08-09]` -> node1..node3, node7,
    gpu08, gpu09 (zero padding kept). One bracket per name, as Slurm writes node names."""
    names: list[str] = []
    depth = 0
    part = ""
    for char in f"{text.strip()},":
        if char == "," and depth == 0:
            if part:
                names.extend(_expand_one(part))
            part = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        part += char
    return names


def _expand_one(part: str) -> list[str]:
    match = _RANGE.match(part)
    if match is None:
        return [part]
    out: list[str] = []
    for span in match["body"].split(","):
        low, _, high = span.partition("-")
        width = len(low) if low.startswith("0") else 0
        if not low.isdigit() or (high and not high.isdigit()):
            return [part]
        for number in range(int(low), int(high or low) + 1):
            out.append(f"{match['prefix']}{number:0{width}d}{match['suffix']}")
    return out


# ---- what Slurm reports ----------------------------------------------------------------------


def _fields(line: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            fields.setdefault(key, value)
    return fields


def _time(text: str) -> float | None:
    """A Slurm timestamp (local time, as Slurm prints it) as epoch seconds; None if unknown."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None  # Unknown, N/A, NONE: no end Slurm can promise


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    base: str  # IDLE, ALLOCATED, MIXED, DOWN, ...
    flags: frozenset[str]  # DRAIN, MAINT, RESERVED, NOT_RESPONDING, ...
    partitions: frozenset[str]
    features: frozenset[str]


@dataclass(frozen=True, slots=True)
class SlurmReservation:
    name: str
    nodes: frozenset[str]
    end_s: float | None


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: str
    name: str
    comment: str
    nodes: tuple[str, ...]
    end_s: float | None

    @property
    def managed(self) -> bool:
        return is_managed_job(self.name, self.comment)


def parse_nodes(text: str) -> list[SlurmNode]:
    """`scontrol show node -o`: one node a line."""
    nodes = []
    for line in text.splitlines():
        f = _fields(line)
        if "NodeName" not in f:
            continue
        state = [token.rstrip("*~#!%$@^-") for token in f.get("State", "UNKNOWN").split("+")]
        features = f.get("AvailableFeatures", "")
        nodes.append(
            SlurmNode(
                name=f["NodeName"],
                base=state[0].upper(),
                flags=frozenset(token.upper() for token in state[1:]),
                partitions=frozenset(p for p in f.get("Partitions", "").split(",") if p),
                features=frozenset(x for x in features.split(",") if x and features != "(null)"),
            )
        )
    return nodes


def parse_reservations(text: str) -> list[SlurmReservation]:
    """`scontrol show reservation -o`: the active reservations (an inactive one holds nothing
    yet)."""
    found = []
    for line in text.splitlines():
        f = _fields(line)
        if "ReservationName" not in f or f.get("State", "ACTIVE") != "ACTIVE":
            continue
        nodes = f.get("Nodes", "")
        found.append(
            SlurmReservation(
                name=f["ReservationName"],
                nodes=frozenset(expand_hostlist(nodes)) if nodes != "(null)" else frozenset(),
                end_s=_time(f.get("EndTime", "")),
            )
        )
    return found


def parse_jobs(text: str) -> list[SlurmJob]:
    """`squeue -h -o "%i<US>%e<US>%N<US>%j<US>%k"` of the jobs that hold nodes."""
    jobs = []
    for line in text.splitlines():
        parts = line.split(_SEP)
        if len(parts) < 4 or not parts[0].strip():
            continue
        nodes = parts[2].strip()
        jobs.append(
            SlurmJob(
                job_id=parts[0].strip(),
                name=parts[3],
                comment=parts[4] if len(parts) > 4 and parts[4] != "(null)" else "",
                nodes=tuple(expand_hostlist(nodes)) if nodes and nodes != "(null)" else (),
                end_s=_time(parts[1]),
            )
        )
    return jobs


# ---- what a pool can use ---------------------------------------------------------------------


def _health(node: SlurmNode) -> str | None:
    """Why the node's own state keeps a managed job off it; None when it could run one."""
    base, flags = node.base, node.flags
    if base == "DOWN":
        return "down"
    if "NOT_RESPONDING" in flags:
        return "not responding"
    if base in {"FAIL", "FAILING"} or flags & {"FAIL", "FAILING"}:
        return "failed"
    if "DRAIN" in flags or base in {"DRAIN", "DRAINED", "DRAINING"}:
        busy = base in _BUSY_BASES or base == "DRAINING" or "COMPLETING" in flags
        return "draining" if busy else "drained"
    if "MAINT" in flags:
        return "in maintenance"
    if flags & _POWER_FLAGS or base in {"POWERED_DOWN", "POWERING_UP", "REBOOT"}:
        return "powered down or rebooting"
    if base in {"UNKNOWN", "FUTURE"}:
        return "not ready (state unknown)"
    return None


def node_capacity(
    target: PoolPartition,
    nodes: Sequence[SlurmNode],
    reservations: Sequence[SlurmReservation],
    jobs: Sequence[SlurmJob],
) -> NodeCapacity:
    """What one pool can use of its partition, by node; pure (the unit tests drive it)."""
    wanted = frozenset(f for f in (target.feature or "").split("&") if f)
    members = [n for n in nodes if target.partition in n.partitions and wanted <= n.features]
    if not members:
        narrowed = f" with feature {target.feature}" if target.feature else ""
        absent = (
            f"partition {target.partition} has no node{narrowed} in Slurm (check "
            "pool_partitions / SLURMGATE_POOL_PARTITIONS)"
        )
        return NodeCapacity(target.partition, idle=0, missing=(MissingNodes(absent, ()),))
    held: dict[str, list[SlurmJob]] = defaultdict(list)
    for job in jobs:
        for name in job.nodes:
            held[name].append(job)
    pool_reservation = next((r for r in reservations if r.name == target.reservation), None)
    missing: dict[str, list[str]] = defaultdict(list)
    returns: Counter[float] = Counter()
    idle = managed = 0
    for node in sorted(members, key=lambda n: n.name):
        why = _health(node)
        back: float | None = None
        if why is None:
            others = [r for r in reservations if node.name in r.nodes and r is not pool_reservation]
            if others:
                why = f"reserved ({', '.join(sorted(r.name for r in others))})"
                ends = [r.end_s for r in others]
                back = None if None in ends else max(e for e in ends if e is not None)
            elif target.reservation and (
                pool_reservation is None or node.name not in pool_reservation.nodes
            ):
                why = f"outside reservation {target.reservation}"
        if why is None:
            outside = [job for job in held.get(node.name, []) if not job.managed]
            if outside:
                why = HELD_OUTSIDE
                ends = [job.end_s for job in outside]
                back = None if None in ends else max(e for e in ends if e is not None)
            elif held.get(node.name):
                managed += 1
                continue
            elif node.base in _BUSY_BASES:
                why = HELD_OUTSIDE  # allocated, but squeue (read a moment later) had no job
        if why is None:
            idle += 1
            continue
        missing[why].append(node.name)
        if back is not None:
            returns[back] += 1
    return NodeCapacity(
        partition=target.partition,
        idle=idle,
        managed=managed,
        missing=tuple(MissingNodes(w, tuple(names)) for w, names in sorted(missing.items())),
        returns=tuple(sorted(returns.items())),
    )


def pool_capacity(
    partitions: Mapping[str, PoolPartition],
    nodes: Sequence[SlurmNode],
    reservations: Sequence[SlurmReservation],
    jobs: Sequence[SlurmJob],
) -> dict[str, NodeCapacity]:
    """`node_capacity` of every mapped pool from one read of Slurm."""
    return {
        pool: node_capacity(target, nodes, reservations, jobs)
        for pool, target in sorted(partitions.items())
    }


def read_pool_capacity(
    partitions: Mapping[str, PoolPartition],
    *,
    timeout: float = 10.0,
    slurm_conf: str | None = None,
) -> dict[str, NodeCapacity]:
    """Read Slurm (three short commands) and say what each mapped pool can use now;
    `slurm_conf` names another cluster's configuration than the controller's own.

    Raises `SlurmError` (and its `SlurmNotConfigured`) when Slurm does not answer: the tick
    then counts runners only (fail-open), with one warning.
    """
    if not partitions:
        return {}
    env = {**command_environment(), "SLURM_CONF": slurm_conf} if slurm_conf else None

    def run(argv: list[str]) -> str:
        return slurm.run(argv, timeout=timeout, env=env).stdout

    node_text = run(["scontrol", "show", "node", "-o"])
    reservation_text = run(["scontrol", "show", "reservation", "-o"])
    job_text = run(["squeue", "-h", "-a", "-t", _HOLDING, "-o", _SQUEUE_FORMAT])
    nodes = parse_nodes(node_text)
    if not nodes:
        raise slurm.SlurmError(["scontrol", "show", "node", "-o"], "listed no nodes")
    return pool_capacity(
        partitions, nodes, parse_reservations(reservation_text), parse_jobs(job_text)
    )
