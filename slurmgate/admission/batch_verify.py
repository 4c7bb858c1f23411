"""One fresh read of the fleet verifies a whole batch of a tick's admissions.

GitHub has no batch read of chosen runners: verifying an N-runner lease alone costs N GETs,
or the runner list's pages. The tick therefore runs its admissions in batches, side by side
(their runners are disjoint), and each admission, once its lease labels are answered, waits
here; one read then serves the batch. Verification stays as safe as a lease's own read: the
read begins only after every write it verifies was answered, so of two controllers writing
conflicting labels, at least one sees the other's (whoever sees the other backs off).

A batch is sized so its writes fit well inside the anchor deadline at the client's write pace
(`verification_batches`): a lease stamped when its batch starts must be anchored within
`leases.anchor_window_s` (20 s, or two thirds of a longer orphan grace), and waiting for a
batch delays its first anchors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from slurmgate.admission.leases import (
    ANCHOR_WITHIN_S,
    AnchorDeadline,
    LeaseClient,
    Verification,
    check_lease,
    read_leased_runners,
    verify_lease,
)
from slurmgate.admission.model import Admit

# Half the anchor deadline goes to a batch's writes; the rest is slack for the read, the
# anchors and retries (an anchor later than the deadline is rolled back, never written).
BUDGET_SHARE = 0.5
BATCH_WRITE_BUDGET_S = ANCHOR_WITHIN_S * BUDGET_SHARE
# Enough to spread one read of a 100-page fleet (10,000 runners) to under a read per admission,
# and few enough that one failed read sends no more than this many admissions to their retry.
MOST_PER_BATCH = 100
# How long the members that asked wait for one still writing (a retry, a slow answer): then the
# read serves those waiting, and the late one reads again on its own.
ROUND_WAIT_SHARE = 0.25
ROUND_WAIT_S = ANCHOR_WITHIN_S * ROUND_WAIT_SHARE


def verification_batches(
    admits: Sequence[Admit],
    write_interval_s: float,
    *,
    budget_s: float = BATCH_WRITE_BUDGET_S,
    most: int = MOST_PER_BATCH,
) -> list[list[Admit]]:
    """The admissions, in plan order, grouped into batches that one read verifies.

    A batch's N + 1 writes per admission, at `write_interval_s` apart (the client's pacing),
    take at most `budget_s` (a single admission always forms a batch); no runner is in two
    admissions of a batch, and there are at most `most` admissions in it.
    """
    if most < 1:
        raise ValueError(f"most must be at least 1; got {most}")
    batches: list[list[Admit]] = []
    current: list[Admit] = []
    writes = 0
    runners: set[int] = set()
    for admit in admits:
        cost = len(admit.runner_ids) + 1
        full = (
            len(current) >= most
            or bool(runners.intersection(admit.runner_ids))
            or (writes + cost) * write_interval_s > budget_s
        )
        if current and full:
            batches.append(current)
            current, writes, runners = [], 0, set()
        current.append(admit)
        writes += cost
        runners.update(admit.runner_ids)
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class BatchShare:
    """What a tick's batch hands each of its admissions: the verification they share (None: a
    batch of one reads on its own) and how long after its stamp an anchor may be written."""

    verifier: BatchVerification | None = None
    anchor_within_s: float = ANCHOR_WITHIN_S

    def deadline(self) -> AnchorDeadline:
        return AnchorDeadline(self.anchor_within_s)


class BatchVerification:
    """The verification step shared by one batch's admissions (`leases.FleetVerifier`).

    A member calls `verify` once its labels are answered and `leave` when its admission ended.
    When every member still expected is waiting, or `round_wait_s` after the first of a round
    asked, one read of all their runners (`leases.read_leased_runners`) serves the round, each
    member checked on it alone (`leases.check_lease`). A member asking while a round is being
    read waits for the next one; one that asks again (a retried step) reads on its own.
    """

    def __init__(
        self,
        admits: Sequence[Admit],
        fleet_size: int | None,
        *,
        round_wait_s: float = ROUND_WAIT_S,
    ) -> None:
        self.fleet_size = fleet_size
        self.round_wait_s = round_wait_s
        self.rounds = 0  # reads made for rounds (a read on one's own is not counted)
        self._expected = {admit.lease_label for admit in admits}
        self._waiting: dict[str, tuple[Admit, asyncio.Future[Verification]]] = {}
        self._client: LeaseClient | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reads: set[asyncio.Task[None]] = set()

    async def verify(self, client: LeaseClient, admit: Admit) -> Verification:
        label = admit.lease_label
        if label not in self._expected or label in self._waiting:
            return await verify_lease(client, admit, fleet_size=self.fleet_size)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Verification] = loop.create_future()
        self._waiting[label] = (admit, answer)
        self._client = client
        if self._timer is None:
            self._timer = loop.call_later(self.round_wait_s, self._read_round)
        self._read_if_all_wait()
        try:
            return await answer
        finally:
            if self._waiting.get(label, (None, None))[1] is answer:  # cancelled before its read
                del self._waiting[label]
                self.leave(admit)

    def leave(self, admit: Admit) -> None:
        self._expected.discard(admit.lease_label)
        self._read_if_all_wait()

    def _read_if_all_wait(self) -> None:
        if self._waiting and self._expected <= self._waiting.keys():
            self._read_round()

    def _read_round(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting or self._client is None:
            return
        members = list(self._waiting.values())
        self._waiting.clear()
        for admit, _ in members:
            self._expected.discard(admit.lease_label)  # served: a retry reads on its own
        self.rounds += 1
        read = asyncio.ensure_future(self._serve(self._client, members))
        self._reads.add(read)  # held until done: the loop keeps only weak references
        read.add_done_callback(self._reads.discard)

    async def _serve(
        self, client: LeaseClient, members: list[tuple[Admit, asyncio.Future[Verification]]]
    ) -> None:
        runner_ids = {runner_id for admit, _ in members for runner_id in admit.runner_ids}
        try:
            fleet = await read_leased_runners(client, runner_ids, self.fleet_size)
        except asyncio.CancelledError:
            for _, answer in members:
                answer.cancel()
            raise
        except Exception as exc:
            for _, answer in members:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for admit, answer in members:
            if answer.done():
                continue
            try:
                answer.set_result(check_lease(admit, fleet))
            except Exception as exc:
                answer.set_exception(exc)
