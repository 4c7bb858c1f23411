"""The event trigger that runs `reconcile` when GitHub queues or finishes a job (via the relay).

`slurmgate webhook` turns GitHub's `workflow_job` deliveries into Prefect events named
`github.workflow_job.<action>` on the resource `github.repo.<owner>.<name>`. This trigger runs the
reconcile deployment on `queued` (something to admit) and `completed` (capacity came back).

Debounce, leading and trailing edge: a reactive trigger with threshold 1 fires on the first
matching event and then ignores matching events for the rest of its `within` window. Alone, that
would strand the jobs queued in the window after the run read the fleet until the 30 s schedule,
so there are two such triggers on the same events:

- `reconcile-now` starts a run at once (the leading edge);
- `reconcile-after-burst` starts one `within` seconds later (`schedule_after`), which sees
  everything queued during the window (the trailing edge).

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


def reconcile_trigger_specs(within_s: float = DEBOUNCE_S) -> list[dict[str, Any]]:
    """The triggers as plain data (the shape of the `triggers:` list in prefect.yaml)."""
    specs = []
    for name, delay in (("reconcile-now", 0), ("reconcile-after-burst", within_s)):
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


def reconcile_triggers(within_s: float = DEBOUNCE_S) -> list[Any]:
    """`DeploymentEventTrigger`s for `reconcile.to_deployment(triggers=...)` / `flow.serve`."""
    from prefect.events import DeploymentEventTrigger

    return [
        DeploymentEventTrigger(**{k: v for k, v in spec.items() if k != "type"})
        for spec in reconcile_trigger_specs(within_s)
    ]
