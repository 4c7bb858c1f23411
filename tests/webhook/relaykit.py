"""Helpers for the relay tests: GitHub-shaped signed deliveries and reading events back."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from slurmgate.testbed.prefect_server import FlowRunSummary, deployment_runs

SECRET = "whsec-test-9f8e7d6c5b4a"


def iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def job_payload(
    job_id: int, action: str = "queued", age_s: float = 0.0, repo: str = "acme/gpu-ci"
) -> dict[str, Any]:
    """A GitHub-shaped workflow_job delivery body, dated `age_s` seconds ago."""
    at = iso(datetime.now(UTC) - timedelta(seconds=age_s))
    return {
        "action": action,
        "workflow_job": {
            "id": job_id,
            "run_id": 777,
            "run_attempt": 1,
            "name": f"bench-{job_id}",
            "status": action if action != "waiting" else "queued",
            "conclusion": "success" if action == "completed" else None,
            "labels": ["self-hosted", "cluster:a", "nodes:2", "ci-job-1.000-abc", "ci-attempt-1"],
            "created_at": at,
            "started_at": at,
            "completed_at": at if action == "completed" else None,
            "runner_name": None,
        },
        "repository": {"full_name": repo, "name": repo.split("/")[1]},
        "sender": {"login": "octocat"},
    }


def deliver(
    url: str,
    payload: dict[str, Any] | bytes,
    *,
    secret: str | None = SECRET,
    delivery: str | None = None,
    event: str = "workflow_job",
    signature: str | None = None,
) -> httpx.Response:
    """POST one delivery the way GitHub does (signed with `secret` unless None)."""
    from slurmgate.github.webhook import signature as sign

    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {
        "content-type": "application/json",
        "x-github-event": event,
        "x-github-delivery": delivery or str(uuid.uuid4()),
    }
    if signature is not None:
        headers["x-hub-signature-256"] = signature
    elif secret is not None:
        headers["x-hub-signature-256"] = sign(secret, body)
    return httpx.post(url, content=body, headers=headers, timeout=15)


def find_events(api: str, **flt: Any) -> list[dict[str, Any]]:
    body = {
        "filter": {"occurred": {"since": iso(datetime.now(UTC) - timedelta(hours=1))}, **flt},
        "limit": 50,
    }
    response = httpx.post(f"{api}/events/filter", json=body, timeout=15)
    assert response.status_code == 200, response.text
    events: list[dict[str, Any]] = response.json()["events"]
    return events


def wait_for_events(
    api: str, count: int, timeout_s: float = 20.0, **flt: Any
) -> list[dict[str, Any]]:
    """Events are persisted asynchronously: poll until `count` match (or time out)."""
    deadline = time.monotonic() + timeout_s
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        found = find_events(api, **flt)
        if len(found) >= count:
            return found
        time.sleep(0.25)
    return found


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def job_labels(token: str, nodes: int) -> list[str]:
    """The runs-on labels of an equal-priority job on pool `a`."""
    return ["self-hosted", "cluster:a", f"nodes:{nodes}", f"ci-job-1.000-{token}", "ci-attempt-1"]


def runs_of(api_url: str, name: str) -> list[FlowRunSummary]:
    """The runs of the served reconcile deployment `name`."""
    return deployment_runs(api_url, f"reconcile/{name}")


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the served processes still running; kill those that do not stop in 15 s."""
    for proc in procs:
        if proc.poll() is not None:
            continue
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
