"""The admission loop: reconcile runs in the served process the moment GitHub queues a job.

Why: with the deployment triggers (deployments/triggers.py) a queued job waited for the
automation, the served runner's poll (10 s by default) and a new Python process per run
(importing Prefect and slurmgate: seconds on a small machine) before its tick even read the
fleet; `benchmarks/results/events.md` measured a median of 8.1 s from queued to anchored. The
tick itself (read, plan, N + 1 paced writes) is a small part of that.

What: `serve.py --events` runs this loop beside the runner, in the same process:

- it subscribes to Prefect's event stream (`get_events_subscriber`, over the server's
  websocket) for the `github.workflow_job.queued` and `.completed` events that `slurmgate
  webhook` posts, and wakes `slurmgate.admission.wakeups.WakeLoop` on each;
- the WakeLoop coalesces the wakes (a tick at once on the first, one pending tick for however
  many arrive while it runs, spaced by a gap; a burst of 50 makes two ticks) and ticks on its
  interval when no event comes (the safety net the deployment's schedule used to be);
- each tick is a run **of the reconcile deployment**, created through the API and executed in
  this process (`prefect.flow_engine.run_flow`): it shows in the UI like any run, its tasks
  retry, its lease task runs and board artifact are the same. Proposing its Pending state takes
  the deployment's concurrency slot (limit 1, CANCEL_NEW), so a loop tick never overlaps a
  manual or scheduled run of the deployment: whichever comes second is cancelled by the
  server, and the loop tries again shortly after;
- a tick that fails or crashes is logged and counted; the loop goes on. A tick whose process
  is killed stops heartbeating and the heartbeat automation (deployments/automations.py) marks
  it Crashed; the process itself is the served runner, so Prefect marks the deployment not
  ready when it stops polling. If the loop itself ends (a bug), `serve_with_admission_loop`
  stops the runner and raises, so the process exits non-zero and its supervisor sees it.

`prefect deploy` users (a worker, no served process) keep the triggers of prefect.yaml.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from slurmgate.admission.wakeups import WakeLoop, WakeSettings
from slurmgate.github.webhook import EVENT_PREFIX

log = logging.getLogger("slurmgate.admission_loop")

WAKE_EVENTS = (f"{EVENT_PREFIX}queued", f"{EVENT_PREFIX}completed")
# After the server cancels a loop tick (another run of the deployment held the slot), the loop
# asks again this much later, so the jobs that woke it are read by a run that starts after them.
COLLISION_RETRY_S = 1.0


def wake_filter() -> Any:
    """The event filter of the jobs that can change what is admitted."""
    from prefect.events.filters import EventFilter, EventNameFilter

    return EventFilter(event=EventNameFilter(name=list(WAKE_EVENTS)))  # type: ignore[call-arg]


async def run_deployment_in_process(flow: Any, deployment_id: UUID, reason: str) -> str:
    """Create a run of the deployment, take its concurrency slot, run it here; its final state
    type ("COMPLETED", "FAILED", ...), "CANCELLED" when another run held the slot, or "TAKEN"
    when the served runner's poll moved it to Pending first (it then runs as a process).

    The run is created Scheduled for now and moved to Pending at once: a run scheduled later
    would be held back by the server (`WaitForScheduledTime`) however it is started."""
    from prefect import get_client
    from prefect.exceptions import Abort
    from prefect.flow_engine import run_flow_async
    from prefect.states import Pending
    from prefect.utilities.engine import propose_state

    async with get_client() as client:
        flow_run = await client.create_flow_run_from_deployment(
            deployment_id, tags=["admission-loop", f"wake-{reason}"]
        )
        try:
            state = await propose_state(client, Pending(), flow_run_id=flow_run.id)
        except Abort:
            return "TAKEN"
        if not state.is_pending():
            return str(state.type.value)
        flow_run = await client.read_flow_run(flow_run.id)
    final = await run_flow_async(
        flow, flow_run=flow_run, parameters=flow_run.parameters, return_type="state"
    )
    return str(getattr(getattr(final, "type", None), "value", "UNKNOWN"))


class AdmissionLoop:
    """Wake on GitHub job events, tick the reconcile deployment in this process."""

    def __init__(
        self,
        flow: Any,
        deployment_id: UUID,
        settings: WakeSettings | None = None,
        *,
        run: Callable[[Any, UUID, str], Any] = run_deployment_in_process,
    ) -> None:
        self.flow = flow
        self.deployment_id = deployment_id
        self.wakes = WakeLoop(self._tick, settings)
        self._run = run
        self.outcomes: dict[str, int] = {}
        self.listening = asyncio.Event()

    async def _tick(self, reason: str) -> None:
        outcome = await self._run(self.flow, self.deployment_id, reason)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "CANCELLED":
            # another run of the deployment holds the slot and may have read the fleet before
            # the job that woke us; try again once it has had time to finish
            log.info("admission tick (%s) cancelled: the deployment is busy; retrying", reason)
            await asyncio.sleep(COLLISION_RETRY_S)
            self.wakes.wake(reason)
        elif outcome != "COMPLETED":
            log.warning("admission tick (%s) ended %s; the loop goes on", reason, outcome)

    async def watch_events(self) -> None:
        """Wake the loop on every job event, reconnecting for ever (with backoff)."""
        from prefect.events.clients import get_events_subscriber

        backoff = 1.0
        while True:
            try:
                async with get_events_subscriber(
                    filter=wake_filter(), reconnect_on_clean_close=True
                ) as subscriber:
                    self.listening.set()
                    backoff = 1.0
                    async for event in subscriber:
                        lag = datetime.now(UTC) - event.occurred
                        log.info(
                            "event %s (%s), %.2f s after it occurred",
                            event.event,
                            event.resource.id,
                            lag.total_seconds(),
                        )
                        self.wakes.wake(event.event.removeprefix(EVENT_PREFIX))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.listening.clear()
                log.warning(
                    "event stream lost (%s: %s); reconnecting in %.0f s, ticking on the interval",
                    type(exc).__name__,
                    exc,
                    backoff,
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def run(self) -> None:
        """Listen, then tick: the first tick runs at once, once the stream is connected (or
        after 10 s without it; the interval covers what the stream would have woken)."""
        watcher = asyncio.create_task(self.watch_events())
        try:
            try:
                await asyncio.wait_for(self.listening.wait(), timeout=10.0)
            except TimeoutError:
                log.warning("event stream not connected after 10 s; ticking on the interval")
            await self.wakes.run()
        finally:
            watcher.cancel()


async def serve_with_admission_loop(
    deployments: list[Any], reconcile_name: str, flow: Any, settings: WakeSettings
) -> None:
    """`prefect.serve` for `deployments`, plus the admission loop ticking the one named
    `reconcile_name` (built from `flow`): one process, one runner, no process per tick. Returns
    when the runner shuts down (SIGTERM); if the loop ends first, the runner is stopped and
    LoopEnded raised, so the process exits non-zero and its supervisor notices."""
    from prefect.runner import Runner

    # the loop's lines (and the core WakeLoop's) go where the runner's go
    ours = logging.getLogger("slurmgate")
    ours.setLevel(logging.INFO)
    ours.handlers = logging.getLogger("prefect").handlers
    runner = Runner()
    ids: dict[str, UUID] = {}
    for deployment in deployments:
        added: Any = runner.add_deployment(deployment)  # sync or async by caller (async here)
        ids[deployment.name] = await added
    loop = AdmissionLoop(flow, ids[reconcile_name], settings)
    served = asyncio.create_task(runner.start(), name="runner")
    ticking = asyncio.create_task(loop.run(), name="admission-loop")
    done, pending = await asyncio.wait({served, ticking}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # re-raises what ended it
    if ticking in done:
        raise LoopEnded("the admission loop ended; the served process stops with it")
    # the runner returns after its own graceful shutdown (SIGTERM, Ctrl-C): so do we


class LoopEnded(RuntimeError):
    """The runner or the admission loop returned, which neither does while healthy."""
