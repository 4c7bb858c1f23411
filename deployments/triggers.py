"""The event trigger that runs `reconcile` when GitHub queues or finishes a job (via the relay).

`slurmgate webhook` turns GitHub's `workflow_job` deliveries into Prefect events named
`github.workflow_job.<action>` on the resource `github.repo.<owner>.<name>`. This trigger runs the
reconcile deployment on `queued` (something to admit) and `completed` (capacity came back).

Debounce: a reactive trigger with threshold 1 fires on the first matching event and then ignores
matching events for the rest of its `within` window, so a burst of 50 queued jobs makes one run
(two when the burst straddles a window). The reconcile run reads the whole fleet, so it admits
every job queued before it started; jobs queued after that wait for the next event past the window
or for the 30 s schedule, which stays as the safety net. `deployments/prefect.yaml` carries the
same trigger for `prefect deploy`; keep the two in step (a test compares them).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

RECONCILE_EVENTS = ("github.workflow_job.queued", "github.workflow_job.completed")
RESOURCE_MATCH = "github.repo.*"
DEBOUNCE_S = 10


def reconcile_trigger_spec(within_s: float = DEBOUNCE_S) -> dict[str, Any]:
    """The trigger as plain data (the shape of a `triggers:` entry in prefect.yaml)."""
    return {
        "type": "event",
        "enabled": True,
        "match": {"prefect.resource.id": RESOURCE_MATCH},
        "expect": list(RECONCILE_EVENTS),
        "posture": "Reactive",
        "threshold": 1,
        "within": within_s,
    }


def reconcile_triggers(within_s: float = DEBOUNCE_S) -> list[Any]:
    """`[DeploymentEventTrigger]` for `reconcile.to_deployment(triggers=...)` / `flow.serve`."""
    from prefect.events import DeploymentEventTrigger
    from prefect.events.schemas.events import ResourceSpecification

    return [
        DeploymentEventTrigger(
            name="reconcile-on-workflow-job",
            match=ResourceSpecification({"prefect.resource.id": RESOURCE_MATCH}),
            expect=set(RECONCILE_EVENTS),
            posture="Reactive",  # type: ignore[arg-type]
            threshold=1,
            within=timedelta(seconds=within_s),
        )
    ]
