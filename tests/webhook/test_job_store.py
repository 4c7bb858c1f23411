"""The relay writes each verified workflow_job delivery to the job-event store the tick reads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from relaykit import deliver, job_payload

from slurmgate.admission.model import JobStatus
from slurmgate.github.jobstore import JobEventStore


def test_deliveries_land_in_the_store_in_order_whatever_order_they_arrive(
    relay_factory: Any, tmp_path: Path
) -> None:
    path = tmp_path / "job-events.sqlite"
    relay = relay_factory(job_store=path)
    running = job_payload(95001, "in_progress", repo="acme/serving")
    running["workflow_job"].update(runner_id=17, runner_name="gpu-17")
    assert deliver(relay.url, running).status_code == 202
    assert deliver(relay.url, job_payload(95001, "queued", repo="acme/serving")).status_code == 202
    assert deliver(relay.url, job_payload(95002, "queued")).status_code == 202
    store = JobEventStore(path)
    seen = store.latest([95001, 95002])
    assert seen[95001].job.status is JobStatus.IN_PROGRESS  # the late queued did not undo it
    assert (seen[95001].repo, seen[95001].job.runner_id) == ("acme/serving", 17)
    assert seen[95002].job.labels[-2:] == ("ci-job-1.000-abc", "ci-attempt-1")
    assert relay.stats["stored"] == 3 and relay.stats["posted"] == 3


def test_what_the_store_refuses_is_still_posted_and_unsigned_is_never_stored(
    relay_factory: Any, tmp_path: Path
) -> None:
    path = tmp_path / "job-events.sqlite"
    relay = relay_factory(job_store=path)
    flood = job_payload(95101)
    flood["workflow_job"]["labels"] = [f"label-{i}" for i in range(500)]
    assert deliver(relay.url, flood).status_code == 202  # GitHub's event still wakes the tick
    assert deliver(relay.url, job_payload(95102), secret="guess").status_code == 401
    no_run = job_payload(95103)
    no_run["workflow_job"]["run_id"] = None
    assert deliver(relay.url, no_run).status_code == 202
    assert JobEventStore(path).latest([95101, 95102, 95103]) == {}
    assert relay.stats["not_stored"] == 2 and relay.stats["posted"] == 2


def test_a_broken_store_costs_the_store_only(relay_factory: Any, tmp_path: Path) -> None:
    path = tmp_path / "job-events.sqlite"
    path.write_bytes(b"this is not sqlite" * 64)
    relay = relay_factory(job_store=path)
    assert deliver(relay.url, job_payload(95201)).status_code == 202
    assert relay.stats["posted"] == 1 and relay.stats["not_stored"] == 1


async def test_the_reconcile_flow_reads_its_jobs_from_the_relays_store(
    relay_factory: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """Emulator webhooks -> relay -> store -> the `reconcile` flow: after the first (full)
    read, a job the relay stored is admitted without a single run or job read."""
    from relaykit import SECRET

    from slurmgate.flows.reconcile import reconcile
    from slurmgate.testbed.emulator.testing import running_emulator

    state = tmp_path / "state"
    relay = relay_factory(job_store=state / "job-events.sqlite")
    flags = {
        "PRIORITY_SCHEDULER_ENABLED": "true",
        "NODE_SLOT_SCHEDULER_ENABLED": "true",
        "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
        "SLURMGATE_ORPHAN_GRACE_S": "0",
        "SLURMGATE_STATE_DIR": str(state),
    }
    for key, value in flags.items():
        monkeypatch.setenv(key, value)
    job_labels = ["self-hosted", "cluster:a", "nodes:2", "ci-attempt-1"]
    with running_emulator({"a": 4}, webhook_urls=[relay.url], webhook_secret=SECRET) as emu:
        monkeypatch.setenv("GITHUB_TOKEN", emu.token)

        def stored(count: int) -> None:
            deadline = time.monotonic() + 20
            while relay.stats["stored"] < count and time.monotonic() < deadline:
                time.sleep(0.05)
            assert relay.stats["stored"] >= count, relay.stats

        emu.admin.add_job([*job_labels, "ci-job-1.000-first"], 600)
        stored(1)
        first = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)
        assert first["admitted"] == 1
        stored(2)  # its in_progress
        second = emu.admin.add_job([*job_labels, "ci-job-1.000-second"], 600)["id"]
        stored(3)
        emu.admin.reset_stats()
        summary = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)
        reads = emu.admin.stats()["requests"]
    assert summary["admitted"] == 1
    assert not [name for name in reads if "/actions/runs" in name or "/actions/jobs" in name]
    assert emu.job_placement(second)[0] == "in_progress"
