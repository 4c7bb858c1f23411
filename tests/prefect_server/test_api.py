"""Blocks, release-lease and reconcile through a real Prefect server's REST API, as CI calls it."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from slurmgate.admission.labels import LeaseLabel

from .conftest import REPO, TOKEN, PrefectServer

pytestmark = pytest.mark.prefect_server


def lease_runners(emulator: Any, job_id: int) -> list[int]:
    """Runner ids that carry a lease label of `job_id` in the emulator."""
    runners = emulator.admin.dump()["runners"]
    held = []
    for runner in runners:
        for label in runner["labels"]:
            name = label["name"]
            if name.startswith("ci-lease-") and LeaseLabel.parse(name).job_id == job_id:
                held.append(runner["id"])
    return sorted(held)


def job_labels(nodes: int, token: str) -> list[str]:
    return ["self-hosted", "cluster:a", f"ci-job-1.000-{token}", "ci-attempt-1", f"nodes:{nodes}"]


def test_blocks_register_with_descriptions_typed_fields_and_a_masked_token(
    served: PrefectServer,
) -> None:
    register = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "blocks"],
        capture_output=True,
        text=True,
        env=served.env(),
        cwd=str(REPO),
        timeout=60,
        check=False,
    )
    assert register.returncode == 0, register.stdout + register.stderr
    assert "slurmgate GitHub Scope" in register.stdout, register.stdout

    api = served.api
    block_type = api.get("/block_types/slug/slurmgate-github-scope").json()
    assert block_type["name"] == "slurmgate GitHub Scope"
    assert "authenticate: a token, or a GitHub App" in block_type["description"]
    assert "GitHubScopeBlock(" in (block_type["code_example"] or "")
    schemas = api.post(
        "/block_schemas/filter",
        json={"block_schemas": {"block_type_id": {"any_": [block_type["id"]]}}},
    ).json()
    fields = schemas[0]["fields"]
    props = fields["properties"]
    for secret in ("token", "app_private_key"):  # optional, each a masked password field
        (shown,) = [kind for kind in props[secret]["anyOf"] if kind.get("type") == "string"]
        assert shown["format"] == "password" and shown["writeOnly"] is True
    # a token or a GitHub App's key: both secrets, neither required alone
    assert {"token", "app_private_key"} <= set(fields["secret_fields"])
    assert props["min_write_interval_s"]["type"] == "number"
    assert props["request_retries"]["type"] == "integer"
    assert "Minimum spacing" in props["min_write_interval_s"]["description"]

    policy_type = api.get("/block_types/slug/slurmgate-admission-policy").json()
    assert "feature flags" in policy_type["description"]

    # the saved scope comes back masked, as the UI shows it; only include_secrets reveals it
    doc = api.get("/block_types/slug/slurmgate-github-scope/block_documents/name/default")
    assert doc.status_code == 200, doc.text
    assert doc.json()["data"]["token"] == "********"
    assert TOKEN not in doc.text
    listed = api.post("/block_documents/filter", json={"limit": 50})
    assert listed.status_code == 200 and TOKEN not in listed.text
    revealed = api.get(
        "/block_types/slug/slurmgate-github-scope/block_documents/name/default",
        params={"include_secrets": "true"},
    )
    assert revealed.json()["data"]["token"] == TOKEN  # the haystack above could have held it


def test_reconcile_then_release_lease_through_the_api_with_an_idempotency_key(
    served: PrefectServer, emulator: Any
) -> None:
    job_id = emulator.admin.add_job(job_labels(2, "rel"), duration_s=600)["id"]

    tick = served.create_run("reconcile/reconcile", {})
    served.wait_state(tick["id"], {"COMPLETED"}, timeout=60)
    assert len(lease_runners(emulator, job_id)) == 2
    keys = {a["key"] for a in served.artifacts(served.run_family(tick["id"]))}
    assert "slurmgate-pool-board" in keys, keys

    key = f"gh-run-{job_id}-release"
    first = served.create_run("release-lease/release-lease", {"job_id": job_id}, key)
    again = served.create_run("release-lease/release-lease", {"job_id": job_id}, key)
    assert again["id"] == first["id"], "the same idempotency key must return the same run"
    assert first["parameters"]["job_id"] == job_id
    done = served.wait_state(first["id"], {"COMPLETED", "FAILED", "CRASHED"}, timeout=60)
    assert done["state"]["type"] == "COMPLETED", served.logs(first["id"])
    assert lease_runners(emulator, job_id) == []
    served.wait_log(first["id"], f"release job={job_id} lease=ci-lease-j{job_id}-")
    # nothing else of the fleet was touched: no lease of any job is left
    runners = emulator.admin.dump()["runners"]
    names = [tuple(label["name"] for label in r["labels"]) for r in runners]
    assert not any(label.startswith("ci-lease-") for labels in names for label in labels)


def test_an_overlapping_reconcile_run_is_cancelled_not_run_concurrently(
    served: PrefectServer, emulator: Any
) -> None:
    emulator.admin.fault("latency", ms=700)  # every GitHub call is slow: the tick takes seconds
    try:
        first = served.create_run("reconcile/reconcile", {})
        served.wait_state(first["id"], {"RUNNING"}, timeout=30)
        second = served.create_run("reconcile/reconcile", {})
        ended = served.wait_state(second["id"], {"CANCELLED", "COMPLETED", "FAILED"}, timeout=30)
        first_state = served.state(first["id"])
        assert ended["state"]["type"] == "CANCELLED", ended["state"]
        assert "concurrency" in (ended["state"]["message"] or "").lower(), ended["state"]
        assert first_state == "RUNNING", "the second run must end while the first still runs"
        history = served.api.get("/flow_run_states/", params={"flow_run_id": second["id"]})
        assert "RUNNING" not in {s["type"] for s in history.json()}, history.json()
    finally:
        emulator.admin.clear_faults()
    served.wait_state(first["id"], {"COMPLETED"}, timeout=60)
