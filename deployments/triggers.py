"""The event trigger that runs `reconcile` when GitHub queues or finishes a job (via the relay).

`slurmgate webhook` turns GitHub's `workflow_job` deliveries into Prefect events named
`github.workflow_job.<action>` on the resource `github.repo.<owner>.<name>`. This trigger runs the
reconcile deployment on `queued` (something to admit) and `completed` (capacity came back).

Debounce, leading and trailing edge: a reactive trigger with threshold 1 fires on the first
matching event and then ignores matching events for the rest of its `within` window. Alone, that
would strand the jobs queued in the window after the run read the fleet until the 30 s schedule,
so there are two such triggers on the same events:

- `reconcile-now` starts a run at once (the leading edge);
- `reconcile-after-burst` schedules one `TRAILING_S` (25 s) later (`schedule_after`), which sees
  everything queued during the window (the trailing edge). Prefect's runner and worker start a
  run up to their prefetch (10 s) *before* its scheduled time (measured), so it really starts
  about 15 s after the first event. The delay must exceed the prefetch plus one reconcile run:
  otherwise the trailing run starts while the leading one still holds the concurrency slot, and
  CANCEL_NEW cancels it (measured with 10 s).

A burst of 50 queued jobs therefore makes two runs, and a continuous stream at most two per
window. The reconcile deployment's concurrency limit (1, CANCEL_NEW) still keeps runs from
overlapping, and the 30 s schedule stays as the safety net. `deployments/prefect.yaml` carries
the same triggers for `prefect deploy`; keep the two in step (a test compares them).
"""

from __future__ import annotations

from typing import Any

RECONCILE_EVENTS = ("github.workflow_job.queued", "github.workflow_job.completed")
RESOURCE_MATCH = "github.repo.*"
DEBOUNCE_S = 10
PREFETCH_S = 10  # Prefect's runner and worker default prefetch
TRAILING_S = DEBOUNCE_S + PREFETCH_S + 5


def reconcile_trigger_specs(
    within_s: float = DEBOUNCE_S, trailing_s: float | None = None
) -> list[dict[str, Any]]:
    """The triggers as plain data (the shape of the `triggers:` list in prefect.yaml)."""
    trailing = within_s + PREFETCH_S + 5 if trailing_s is None else trailing_s
    specs = []
    for name, delay in (("reconcile-now", 0.0), ("reconcile-after-burst", trailing)):
        spec: dict[str, Any] = {
            "name": name,
            "type": "event",
            "enabled": True,
            "match": {"prefect.resource.id": RESOURCE_MATCH},
            "expect": list(RECONCILE_EVENTS),
            "posture": "Reactive",
            "threshold": 1,
            "within": within_s,
        }
        if delay:
            spec["schedule_after"] = delay
        specs.append(spec)
    return specs


def reconcile_triggers(within_s: float = DEBOUNCE_S, trailing_s: float | None = None) -> list[Any]:
    """`DeploymentEventTrigger`s for `reconcile.to_deployment(triggers=...)` / `flow.serve`."""
    from prefect.events import DeploymentEventTrigger

    return [
        DeploymentEventTrigger(**{k: v for k, v in spec.items() if k != "type"})
        for spec in reconcile_trigger_specs(within_s, trailing_s)
    ]
