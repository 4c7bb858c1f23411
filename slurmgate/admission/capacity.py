"""Capacity while a plan is made: pools, free runners, running leases and their time profile.

`FleetState` is what the policies query and consume; the planner builds one per plan from a
snapshot, and the simulator keeps one across its events. Where a pool is mapped to a Slurm
partition, its `NodeCapacity` (read by an adapter, `slurm/capacity.py`) caps what the
runners offer: usable capacity = min(free runners, nodes Slurm can give a managed job now).
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from slurmgate.admission.estimates import Estimate, expected_end
from slurmgate.admission.model import Blocked, Job, Lease
from slurmgate.errors import ExternalError

DEFAULT_ESTIMATE = Estimate(480 * 60.0, 480 * 60.0)

LEGACY = "(legacy)"
"""Board name of the runners without a `cluster:` label; they serve 1-node jobs only."""


@dataclass(frozen=True, slots=True)
class MissingNodes:
    """Nodes of a pool's partition that cannot run a managed job now, and why (one word)."""

    why: str  # "drained", "down", "held by jobs outside slurmgate", "reserved (maint)", ...
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    """What Slurm says about one pool's partition: the nodes a managed job could get.

    `idle` nodes can take a new managed job now; `managed` nodes are allocated to managed jobs
    (their leases already count them); `missing` are the rest, grouped by why. `returns` are
    (time, nodes) when Slurm expects missing nodes back: the end times of outside jobs and of
    reservations, which the reservation policies add to their time profile.
    """

    partition: str
    idle: int
    managed: int = 0
    missing: tuple[MissingNodes, ...] = ()
    returns: tuple[tuple[float, int], ...] = ()

    @property
    def usable(self) -> int:
        """Nodes that run a managed job now or could: idle, or already ours."""
        return self.idle + self.managed

    @property
    def total(self) -> int:
        return self.usable + sum(len(group.nodes) for group in self.missing)

    def reasons(self) -> list[str]:
        """One phrase per group of missing nodes: "2 nodes drained in partition gpu: node[3-4]"."""
        return [
            f"{len(group.nodes)} node{'s' if len(group.nodes) != 1 else ''} {group.why} in "
            f"partition {self.partition}: {compact_hostlist(group.nodes)}"
            if group.nodes
            else group.why
            for group in self.missing
        ]

    def summary(self) -> str:
        """The board's line: usable nodes of the partition, and why the others are missing."""
        head = f"{self.usable}/{self.total} nodes usable in partition {self.partition}"
        return "; ".join([head, *self.reasons()])


_NUMBERED = re.compile(r"^(?P<prefix>.*?)(?P<number>\d+)$")


def compact_hostlist(names: Iterable[str]) -> str:
    """Slurm's compact form of a node list: node1,node2,node3,gpu07 -> gpu07,node[1-3].

    Names sharing a prefix and a digit width fold into ranges (zero padding is kept, as Slurm
    writes it); names without a trailing number stay as they are.
    """
    plain: list[str] = []
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for name in sorted(set(names)):
        match = _NUMBERED.match(name)
        if match is None:
            plain.append(name)
            continue
        digits = match["number"]
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        groups[(match["prefix"], width)].append(int(digits))
    parts = list(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        numbers.sort()
        spans: list[str] = []
        start = prev = numbers[0]
        for number in [*numbers[1:], None]:
            if number is not None and number == prev + 1:
                prev = number
                continue
            spans.append(
                f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}"
            )
            if number is not None:
                start = prev = number
        if len(numbers) == 1:
            parts.append(f"{prefix}{spans[0]}")
        else:
            parts.append(f"{prefix}[{','.join(spans)}]")
    return ",".join(sorted(parts))


class CapacityUnread(ExternalError):
    """Some Slurm clusters did not answer a capacity read: `capacity` is what the others said,
    `unread` is per cluster why and its pools (which count runners only)."""

    def __init__(
        self,
        capacity: Mapping[str, NodeCapacity],
        unread: Mapping[str, tuple[str, tuple[str, ...]]],
    ) -> None:
        self.capacity = dict(capacity)
        self.unread = dict(unread)
        super().__init__(
            "; ".join(f"cluster {name} unread ({why})" for name, (why, _) in sorted(unread.items()))
        )


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A queued managed job, sized and scored, with the runners its labels are compatible with."""

    job: Job
    nodes: int
    score: Decimal
    priority: str
    requirement: frozenset[str]
    estimate: Estimate = DEFAULT_ESTIMATE
    skip_queue: bool = False  # a verified skip-queue job: outranks every score
    repo: str | None = None  # OWNER/NAME, folded; None: unknown (the simulator's jobs)


@dataclass(slots=True)
class PoolState:
    """The working capacity of one pool while a plan is being made."""

    name: str
    total: int
    online: int
    in_use: int
    free: list[int]  # free runner ids, sorted
    admitted: int = 0
    blocked: int = 0
    slurm: NodeCapacity | None = None  # None: runner-only capacity (no partition, or unread)
    cordoned: str | None = None  # why nothing new is admitted here; None: open


@dataclass(frozen=True, slots=True)
class Placement:
    request: JobRequest
    pool: str | None
    runner_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RunningLease:
    """A kept lease as a reservation policy sees it: its nodes from its start until its end."""

    job_id: int
    nodes: int
    started_s: float
    estimate: Estimate


class AdmissionGate(Protocol):
    """A rule besides capacity that a job must pass to start now (the repository and team
    node quotas of `admission/fairness.py`): `refuse` says why it waits, `charge` counts an
    admission against it."""

    def refuse(self, request: JobRequest, fleet: FleetState) -> Blocked | None: ...

    def charge(self, request: JobRequest, nodes: int) -> None: ...


class FleetState:
    """Capacity per pool and the compatibility index; policies query and consume it.

    The planner builds one from a snapshot per plan; the simulator keeps one across events
    (`start` on admission, `finish` on completion) and hands it to the same policies.
    """

    def __init__(
        self,
        pools: dict[str, PoolState],
        legacy_free: list[int],
        legacy_total: int,
        runner_pool: dict[int, str | None],
        label_index: dict[str, set[int]],
        eligible: frozenset[int],
        leases: tuple[Lease, ...] = (),
        now_s: float = 0.0,
        running: dict[str, dict[int, RunningLease]] | None = None,
        extension_s: float = 600.0,
    ) -> None:
        self.pools = pools
        self.leases = leases
        self.now_s = now_s
        # what a reservation policy needs to predict when capacity returns: pool -> job -> lease
        self.running: dict[str, dict[int, RunningLease]] = running if running is not None else {}
        self.extension_s = extension_s
        self.legacy_free = legacy_free
        self.legacy_total = legacy_total
        self.legacy_admitted = 0
        self._runner_pool = runner_pool
        self._label_index = label_index
        self._eligible = eligible
        # requirement -> {pool or None(legacy): candidate runner ids, or None meaning "all"}
        self._cache: dict[frozenset[str], dict[str | None, frozenset[int] | None]] = {}
        self.gate: AdmissionGate | None = None  # quotas a placement must also pass

    def candidates(self, requirement: frozenset[str]) -> dict[str | None, frozenset[int] | None]:
        """The pools (None = legacy) holding runners that carry every label of `requirement`.

        A value of None means every runner of that pool qualifies (the common case), which lets
        a placement take the pool's free list as is.
        """
        cached = self._cache.get(requirement)
        if cached is not None:
            return cached
        if requirement:
            sets = sorted((self._label_index.get(label, set()) for label in requirement), key=len)
            matched = set(sets[0])
            for other in sets[1:]:
                matched &= other
                if not matched:
                    break
            matched &= self._eligible
        else:
            matched = set(self._eligible)
        grouped: dict[str | None, set[int]] = defaultdict(set)
        for runner_id in matched:
            grouped[self._runner_pool[runner_id]].add(runner_id)
        result: dict[str | None, frozenset[int] | None] = {}
        for pool in sorted(grouped, key=lambda p: (p is not None, p or "")):
            ids = grouped[pool]
            size = self.pools[pool].total if pool is not None else self.legacy_total
            result[pool] = None if len(ids) == size else frozenset(ids)
        self._cache[requirement] = result
        return result

    def free_for(self, pool: str | None, allowed: frozenset[int] | None) -> list[int]:
        free = self.legacy_free if pool is None else self.pools[pool].free
        return list(free) if allowed is None else [rid for rid in free if rid in allowed]

    def free_count(self, pool: str | None, allowed: frozenset[int] | None) -> int:
        free = self.legacy_free if pool is None else self.pools[pool].free
        return len(free) if allowed is None else sum(1 for rid in free if rid in allowed)

    def total_for(self, pool: str | None, allowed: frozenset[int] | None) -> int:
        if allowed is not None:
            return len(allowed)
        return self.legacy_total if pool is None else self.pools[pool].total

    def take(self, pool: str | None, runner_ids: Sequence[int]) -> None:
        free = self.legacy_free if pool is None else self.pools[pool].free
        for rid in runner_ids:
            del free[bisect.bisect_left(free, rid)]
        if pool is None:
            self.legacy_admitted += len(runner_ids)
        else:
            self.pools[pool].in_use += len(runner_ids)
            self.pools[pool].admitted += len(runner_ids)

    def start(self, placement: Placement) -> None:
        """Admit a placement: take its runners and expect them back after its estimate."""
        self.take(placement.pool, placement.runner_ids)
        if self.gate is not None:
            self.gate.charge(placement.request, len(placement.runner_ids))
        if placement.pool is not None:
            request = placement.request
            self.running.setdefault(placement.pool, {})[request.job.id] = RunningLease(
                request.job.id, len(placement.runner_ids), self.now_s, request.estimate
            )

    def finish(self, pool: str | None, job_id: int, runner_ids: Sequence[int]) -> None:
        """A lease ended (used by the simulator): its runners are free again."""
        free = self.legacy_free if pool is None else self.pools[pool].free
        for rid in runner_ids:
            bisect.insort(free, rid)
        if pool is not None:
            self.pools[pool].in_use -= len(runner_ids)
            self.running.get(pool, {}).pop(job_id, None)
        else:
            self.legacy_admitted -= len(runner_ids)

    def headroom(self, pool: str) -> int:
        """Nodes a new admission may take in `pool`: online runners not in use, and where the
        pool has a partition, nodes Slurm can give a managed job now.

        In Slurm terms: usable (idle or ours) nodes not held by a lease, and never more than
        the idle ones not taken by this plan (a lease whose job has not allocated yet holds
        idle nodes; a managed allocation without a lease does not free any).
        """
        state = self.pools[pool]
        if state.cordoned is not None:
            return 0  # cordoned: its leases finish, nothing new starts
        room = state.online - state.in_use
        if state.slurm is not None:
            room = min(room, state.slurm.usable - state.in_use, state.slurm.idle - state.admitted)
        return max(0, room)

    def slurm_short(self, pool: str, nodes: int) -> bool:
        """True when the runners could take `nodes` now but Slurm's nodes cannot."""
        state = self.pools[pool]
        return state.slurm is not None and state.online - state.in_use >= nodes > self.headroom(
            pool
        )

    def available(self, pool: str) -> int:
        """Runners of `pool` a job could take now: free tokens, within online capacity (and
        within the nodes Slurm can give, for a pool with a partition)."""
        return min(len(self.pools[pool].free), self.headroom(pool))

    def profile(self, pool: str, predicted: bool = False) -> Profile:
        """Free runners of `pool` from now on, as running leases are expected to end: at their
        timeouts, or with `predicted` at their predictions first (and, for a pool with a
        partition, as Slurm expects outside jobs and reservations to end)."""
        ends = [
            (
                expected_end(
                    lease.started_s, lease.estimate, self.now_s, self.extension_s, predicted
                ),
                lease.nodes,
            )
            for lease in self.running.get(pool, {}).values()
        ]
        state = self.pools[pool]
        cap = state.online
        if state.slurm is not None:
            # an end Slurm already passed (a job over its limit, being killed) is "soon", not now
            ends += [(max(end, self.now_s + 1.0), nodes) for end, nodes in state.slurm.returns]
            cap = min(cap, state.slurm.usable + sum(n for _, n in state.slurm.returns))
        return Profile(self.now_s, self.available(pool), cap, ends)


class Profile:
    """Free runners of one pool over time, piecewise constant from now; reservations subtract.

    `times[i]` starts a segment with `free[i]` runners free until `times[i + 1]` (the last one
    lasts forever). Built from running leases' expected ends, capped at the pool's online size.
    """

    __slots__ = ("free", "times")

    def __init__(self, now_s: float, free_now: int, cap: int, ends: Iterable[tuple[float, int]]):
        self.times = [now_s]
        self.free = [free_now]
        for end, nodes in sorted(ends):
            level = min(cap, self.free[-1] + nodes)
            if end <= self.times[-1]:
                self.free[-1] = level
            else:
                self.times.append(end)
                self.free.append(level)

    def earliest(self, nodes: int, duration_s: float) -> float | None:
        """The first time `nodes` runners stay free for `duration_s`; None if never."""
        times, free = self.times, self.free
        last = len(times) - 1
        start: float | None = None
        for i in range(last + 1):
            if free[i] >= nodes:
                if start is None:
                    start = times[i]
                if i == last or times[i + 1] >= start + duration_s:
                    return start
            else:
                start = None
        return None

    def fits_now(self, nodes: int, duration_s: float) -> bool:
        return self.earliest(nodes, duration_s) == self.times[0]

    def reserve(self, start_s: float, duration_s: float, nodes: int) -> None:
        """Hold `nodes` runners over [start, start + duration)."""
        end_s = start_s + duration_s
        i = self._split(start_s)
        j = self._split(end_s)
        for k in range(i, j):
            self.free[k] -= nodes

    def _split(self, at: float) -> int:
        index = bisect.bisect_left(self.times, at)
        if index < len(self.times) and self.times[index] == at:
            return index
        self.times.insert(index, at)
        self.free.insert(index, self.free[index - 1])
        return index
