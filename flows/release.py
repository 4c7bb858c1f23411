"""The release-lease flow: free one job's lease at once when its CI job ends."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from slurmgate.admission.labels import is_lease
from slurmgate.admission.leases import lease_labels_for_job
from slurmgate.tasks.github import bound_client, current_client, remove_labels_task, resolve_scope


@flow(name="release-lease", flow_run_name="release-lease-j{job_id}", log_prints=False)
async def release_lease(
    job_id: int,
    attempt: int | None = None,
    scope_block: str | None = "default",
    api_url: str | None = None,
    repo: str | None = None,
    org: str | None = None,
) -> dict[str, Any]:
    """Remove the lease labels of `job_id` (optionally one attempt) and its anchor's job labels.

    The CI job's `if: always()` step triggers this through the Prefect API, so the capacity
    returns before the next reconcile tick. Idempotent: a second call finds nothing to remove.
    """
    logger = get_run_logger()
    if job_id < 1:
        raise ValueError(f"job_id must be a positive GitHub job id, got {job_id}")
    scope = await resolve_scope(scope_block, api_url, repo, org)
    async with scope.get_client() as client, bound_client(client):
        fleet = await current_client().list_runners(conditional=True)
        pairs = lease_labels_for_job(fleet, job_id, attempt)
        if not pairs:
            logger.info("release job=%s attempt=%s: no lease labels found", job_id, attempt)
            return {"job_id": job_id, "runners": 0, "removed": 0, "already_gone": 0}
        outcome = await remove_labels_task(pairs)
    leases = sorted({label for _, labels in pairs for label in labels if is_lease(label)})
    logger.info(
        "release job=%s lease=%s runners=%d removed=%d already_gone=%d reason=ci-job-ended",
        job_id,
        ",".join(leases),
        len(pairs),
        len(outcome.removed),
        len(outcome.already_gone),
    )
    return {
        "job_id": job_id,
        "runners": len(pairs),
        "removed": len(outcome.removed),
        "already_gone": len(outcome.already_gone),
    }
