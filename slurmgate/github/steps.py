"""The reconcile tick's steps straight over a GitHub client, without Prefect's retries."""

from __future__ import annotations

from collections.abc import Sequence

from slurmgate.admission.leases import AdmitOutcome, RemovalOutcome, admit_lease, remove_labels
from slurmgate.admission.model import Admit, Snapshot
from slurmgate.admission.tick import TickSteps
from slurmgate.github.client import GitHubClient
from slurmgate.github.snapshot import take_snapshot


def direct_steps(client: GitHubClient, *, read_only: bool = False) -> TickSteps:
    """Read with `take_snapshot`; remove and admit with the core lease protocol (N + 1 writes a
    lease). `read_only` plans and writes nothing, as `slurmgate status` does."""

    async def read() -> Snapshot:
        return await take_snapshot(client)

    if read_only:
        return TickSteps(read)

    async def remove(pairs: Sequence[tuple[int, Sequence[str]]]) -> RemovalOutcome:
        return await remove_labels(client, pairs)

    async def admit(a: Admit, fleet_size: int) -> AdmitOutcome:
        return await admit_lease(client, a, fleet_size=fleet_size)

    return TickSteps(read, remove=remove, admit=admit)
