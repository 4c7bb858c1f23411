"""The reconcile tick's steps straight over a GitHub client, without Prefect's retries."""

from __future__ import annotations

from collections.abc import Sequence

from slurmgate.admission.leases import (
    AdmitOutcome,
    DispatchCheck,
    RemovalOutcome,
    admit_lease,
    read_dispatch,
    remove_labels,
)
from slurmgate.admission.model import Admit, Snapshot
from slurmgate.admission.settings import AdmissionSettings
from slurmgate.admission.tick import TickSteps
from slurmgate.github.client import GitHubClient
from slurmgate.github.snapshot import take_snapshot


def direct_steps(
    client: GitHubClient, *, read_only: bool = False, settings: AdmissionSettings | None = None
) -> TickSteps:
    """Read with `take_snapshot`; remove and admit with the core lease protocol (N + 1 writes a
    lease). `read_only` plans and writes nothing, as `slurmgate status` does; `settings` lets
    the read verify skip-queue jobs (without them none is)."""

    async def read() -> Snapshot:
        return await take_snapshot(client, settings=settings)

    if read_only:
        return TickSteps(read)

    async def remove(pairs: Sequence[tuple[int, Sequence[str]]]) -> RemovalOutcome:
        return await remove_labels(client, pairs)

    async def admit(a: Admit, fleet_size: int) -> AdmitOutcome:
        return await admit_lease(client, a, fleet_size=fleet_size)

    async def dispatch(job_id: int, anchor_id: int | None) -> DispatchCheck:
        return await read_dispatch(client, job_id, anchor_id)

    return TickSteps(read, remove=remove, admit=admit, read_dispatch=dispatch)
