"""The heartbeat automation: mark a flow run Crashed when its heartbeats stop (SIGKILL, host loss).

A flow run whose process is SIGKILLed, or whose host dies, never reports a final state: out of
the box it stays `Running` for ever, and so do the leases and Slurm steps it holds. Every flow
run sends a `prefect.flow-run.heartbeat` event every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds
(180 by default). This proactive automation watches each run separately (`for_each` resource)
and, when `within_s` passes after a heartbeat with neither another heartbeat nor a final state,
sets the run to `Crashed`. Reconcile then treats what the run held as stale.

Create or update it (idempotent, by name) once per Prefect server, after `prefect deploy`:

    python -m slurmgate.deployments.automations    # within = 3 heartbeats + 60 s (600 s)
    python -m slurmgate.deployments.automations --within 150 --heartbeat 30

`--heartbeat` must match the PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the workers and serve
processes that run the flows (this process's own setting is the default).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import timedelta
from typing import Any

AUTOMATION_NAME = "slurmgate-crash-silent-flow-runs"
FINAL_EVENTS = (
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
)
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
MIN_WITHIN_S = 10.0  # Prefect's floor for proactive triggers


class AutomationConfigError(ValueError):
    """The heartbeat and the silence window do not fit together."""


def configured_heartbeat_s() -> float | None:
    """This process's PREFECT_FLOWS_HEARTBEAT_FREQUENCY (None when heartbeats are off)."""
    from prefect.settings import get_current_settings

    frequency = get_current_settings().flows.heartbeat_frequency
    return None if frequency is None else float(frequency)


def default_within_s(heartbeat_s: float) -> float:
    """Three missed heartbeats plus a minute: 600 s for the default 180 s heartbeat."""
    return 3 * heartbeat_s + 60


def check_window(within_s: float, heartbeat_s: float | None) -> None:
    """Raise naming the setting when the window would never fire or would crash healthy runs."""
    if heartbeat_s is None:
        raise AutomationConfigError(
            "flow-run heartbeats are off (PREFECT_FLOWS_HEARTBEAT_FREQUENCY is empty), so the "
            "automation would never fire; set PREFECT_FLOWS_HEARTBEAT_FREQUENCY=180 (or 30..) "
            "on the workers, or pass --heartbeat with their value"
        )
    if within_s < MIN_WITHIN_S:
        raise AutomationConfigError(
            f"within_s={within_s:g} is below Prefect's {MIN_WITHIN_S:g} s minimum for proactive "
            "triggers; pass a longer --within"
        )
    if within_s <= heartbeat_s:
        raise AutomationConfigError(
            f"within_s={within_s:g} must be longer than the heartbeat interval "
            f"({heartbeat_s:g} s), or every healthy run is marked Crashed; use about "
            f"{default_within_s(heartbeat_s):g} (--within)"
        )


def heartbeat_automation_spec(
    within_s: float | None = None,
    heartbeat_s: float | None = None,
    name: str = AUTOMATION_NAME,
) -> Any:
    """The automation as an `AutomationCore` (not yet on any server)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    beat = configured_heartbeat_s() if heartbeat_s is None else heartbeat_s
    window = within_s if within_s is not None else default_within_s(beat or 180.0)
    check_window(window, beat)
    return AutomationCore(
        name=name,
        description=(
            f"Marks a flow run Crashed when {window:g} s pass after a heartbeat with neither "
            "another heartbeat nor a final state (its process was killed or its host lost). "
            "Shipped with slurmgate's deployments; reconcile then reaps what the run held."
        ),
        enabled=True,
        trigger=EventTrigger(
            after={HEARTBEAT_EVENT},
            expect={HEARTBEAT_EVENT, *FINAL_EVENTS},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=window),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {window:g} s (process killed or host lost)",
            )
        ],
    )


async def aensure_heartbeat_automation(
    within_s: float | None = None,
    heartbeat_s: float | None = None,
    name: str = AUTOMATION_NAME,
) -> Any:
    """Create the automation, or update the one of that name; returns its id.

    Idempotent: running it again (say after every deploy) leaves exactly one automation.
    """
    from prefect import get_client

    spec = heartbeat_automation_spec(within_s, heartbeat_s, name)
    async with get_client() as client:
        existing = await client.read_automations_by_name(name)
        if not existing:
            return await client.create_automation(spec)
        keep, *duplicates = existing
        await client.update_automation(keep.id, spec)
        for extra in duplicates:
            await client.delete_automation(extra.id)
        return keep.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="example: python -m slurmgate.deployments.automations --within 150 --heartbeat 30",
    )
    parser.add_argument(
        "--within",
        type=float,
        default=None,
        help="seconds of silence after a heartbeat before a run is marked Crashed "
        "(default: 3 heartbeats + 60 s)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        default=None,
        help="the workers' PREFECT_FLOWS_HEARTBEAT_FREQUENCY (default: this process's setting)",
    )
    parser.add_argument("--name", default=AUTOMATION_NAME)
    args = parser.parse_args(argv)
    try:
        automation_id = asyncio.run(
            aensure_heartbeat_automation(args.within, args.heartbeat, args.name)
        )
    except AutomationConfigError as exc:
        print(f"automations: {exc}", file=sys.stderr)
        return 2
    print(f"automation {args.name!r} ready: {automation_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
