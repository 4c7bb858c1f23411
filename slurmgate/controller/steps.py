"""The reconcile tick's steps straight over a GitHub client, without Prefect's retries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from slurmgate.admission.batch_verify import BatchShare
from slurmgate.admission.capacity import NodeCapacity
from slurmgate.admission.leases import (
    AdmitOutcome,
    DispatchCheck,
    RemovalOutcome,
    admit_lease,
    read_dispatch,
    remove_labels,
)
from slurmgate.admission.model import Admit, Snapshot
from slurmgate.admission.tick import ReadCapacity, TickSteps
from slurmgate.github.client import GitHubClient
from slurmgate.github.snapshot import EventReads, take_snapshot
from slurmgate.settings.admission import AdmissionSettings, PoolPartition
from slurmgate.settings.slurm import SlurmRestSettings
from slurmgate.slurm.capacity import read_pool_capacity
from slurmgate.slurm.clusters import ClusterReads
from slurmgate.slurm.slurmrestd import SlurmRestConfigError, read_rest_capacity, rest_settings


def direct_steps(
    client: GitHubClient,
    *,
    read_only: bool = False,
    settings: AdmissionSettings | None = None,
    events: EventReads | None = None,
) -> TickSteps:
    """Read with `take_snapshot`; remove and admit with the core lease protocol (N + 1 writes a
    lease); `events` reads the jobs from the relay's job-event store (without, every read
    polls). `read_only` plans and writes nothing, as `slurmgate status` does; `settings` lets
    the read verify skip-queue jobs (without them none is) and, where it maps pools to
    partitions, reads Slurm's nodes with every snapshot (`slurm_capacity_step`)."""

    async def read() -> Snapshot:
        return await take_snapshot(client, settings=settings, events=events)

    capacity = slurm_capacity_step(settings)
    if read_only:
        return TickSteps(read, read_capacity=capacity)

    async def remove(pairs: Sequence[tuple[int, Sequence[str]]]) -> RemovalOutcome:
        return await remove_labels(client, pairs)

    async def admit(a: Admit, fleet_size: int, share: BatchShare) -> AdmitOutcome:
        return await admit_lease(
            client, a, fleet_size=fleet_size, verifier=share.verifier, deadline=share.deadline()
        )

    async def dispatch(job_id: int, anchor_id: int | None) -> DispatchCheck:
        return await read_dispatch(client, job_id, anchor_id)

    return TickSteps(
        read,
        remove=remove,
        admit=admit,
        read_dispatch=dispatch,
        read_capacity=capacity,
        write_interval_s=client.min_write_interval_s,
    )


def slurm_capacity_step(
    settings: AdmissionSettings | None, rest: SlurmRestSettings | None = None
) -> ReadCapacity | None:
    """The tick's Slurm read for the settings' pool partitions (None when none is mapped):
    from slurmrestd when $SLURMGATE_SLURMRESTD_URL names it, else with Slurm's commands; either
    runs in a thread, so the tick's event loop keeps serving."""
    if settings is None or not settings.pool_partitions:
        return None
    partitions = dict(settings.pool_partitions)
    try:
        rest = rest or rest_settings()
    except SlurmRestConfigError as exc:
        # a misconfigured read is a failed read: each tick warns with the fix, runner-only
        failure = exc

        def own(pools: Mapping[str, PoolPartition]) -> dict[str, NodeCapacity]:
            raise failure

    else:
        reader = rest

        def own(pools: Mapping[str, PoolPartition]) -> dict[str, NodeCapacity]:
            if reader.url:
                return read_rest_capacity(reader, pools)
            return read_pool_capacity(pools)

    if any(target.cluster for target in partitions.values()):
        # pools in several clusters: each read on its own, each failing open alone
        read: Callable[[], dict[str, NodeCapacity]] = ClusterReads(
            partitions, settings.slurm_clusters, own
        )
    else:
        read = partial(own, partitions)

    async def read_capacity() -> Mapping[str, NodeCapacity]:
        return await asyncio.to_thread(read)

    return read_capacity
