"""Each admission is one `lease` task run, visible in Prefect: named for its job and attempt,
retried by Prefect on a transient fault, and carrying its rollback in its own log; the tick's
per-job decision lines reach Prefect grouped, not one record per job."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from uuid import UUID

import pytest
from flowcheck import fleet, job_labels, managed_on
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentTaskRunId,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTaskRunId,
)
from prefect.client.schemas.objects import TaskRun
from prefect.logging.handlers import APILogHandler

from slurmgate.flows.reconcile import reconcile

NODES = 4


async def tick(emu: Any, monkeypatch: pytest.MonkeyPatch) -> UUID:
    """One reconcile tick; the flow run's id (whether it failed or not)."""
    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    state = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    assert flow_run_id is not None
    return flow_run_id


async def task_runs(flow_run_id: UUID, count: int, timeout_s: float = 20.0) -> list[TaskRun]:
    """The flow run's task runs once `count` lease runs are recorded in a final state (the
    server records task runs from their events, a moment after the flow ends)."""
    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            leases = [r for r in runs if r.name.startswith("lease-")]
            if len(leases) >= count and all(r.state and r.state.is_final() for r in leases):
                return runs
            assert time.monotonic() < deadline, f"lease task runs not recorded: {runs}"
            await asyncio.sleep(0.2)


async def logs_of(task_run_id: UUID) -> list[str]:
    await APILogHandler.aflush()
    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id]))
        )
    return [log.message for log in logs]


async def test_each_admission_is_one_lease_task_run_named_for_its_job(
    emulator_factory, monkeypatch
) -> None:
    emu = emulator_factory({"a": 10})
    jobs = [
        emu.admin.add_job(job_labels(NODES, token=f"t{i}"), duration_s=600)["id"] for i in (1, 2)
    ]
    flow_run_id = await tick(emu, monkeypatch)

    runs = await task_runs(flow_run_id, count=2)
    leases = {r.name: r for r in runs if r.name.startswith("lease-")}
    assert set(leases) == {f"lease-j{job}-a1" for job in jobs}
    assert all(r.state is not None and r.state.is_completed() for r in leases.values())
    assert all(r.run_count == 1 for r in leases.values())
    # the protocol's steps are inside the lease task: no step task runs, no lease subflow runs
    others = [r.name for r in runs if r.name not in leases]
    assert others and all(name.startswith("read-snapshot-") for name in others), others
    async with get_client() as client:
        subflows = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[r.id for r in runs])
            )
        )
    assert subflows == []
    for job, run in zip(jobs, sorted(leases.values(), key=lambda r: r.name), strict=True):
        assert any(
            f"admitted job={job} lease=ci-lease-j{job}-a1-" in m for m in await logs_of(run.id)
        )


async def test_a_transient_fault_is_a_prefect_retry_of_the_lease_task(
    emulator_factory, monkeypatch
) -> None:
    """A 502 on the 3rd label write with no client retries: Prefect runs the lease task again,
    which resumes (one repeated write) instead of rolling back."""
    monkeypatch.setenv("SLURMGATE_REQUEST_RETRIES", "0")
    emu = emulator_factory({"a": 6})
    job_id = emu.admin.add_job(job_labels(NODES), duration_s=600)["id"]
    emu.admin.fault("fail_nth_write", n=3, status=502)
    emu.admin.reset_stats()
    flow_run_id = await tick(emu, monkeypatch)

    (run,) = [r for r in await task_runs(flow_run_id, 1) if r.name == f"lease-j{job_id}-a1"]
    assert run.run_count == 2 and run.state is not None and run.state.is_completed()
    assert emu.admin.stats()["writes"] == NODES + 1 + 1
    assert len(managed_on(fleet(emu.admin.dump()))) == NODES
    assert not any("rollback" in m for m in await logs_of(run.id))


async def test_a_rollback_is_logged_on_the_failed_lease_task_run(
    emulator_factory, monkeypatch
) -> None:
    """A 422 on the 3rd label write: the lease task run fails once (never retried) and its
    own log names the job, the lease and the three removals it ran (the rejected write's undo
    was registered before it was sent: a write that failed may still have landed)."""
    emu = emulator_factory({"a": 6})
    job_id = emu.admin.add_job(job_labels(NODES), duration_s=600)["id"]
    emu.admin.fault("fail_nth_write", n=3, status=422)
    flow_run_id = await tick(emu, monkeypatch)

    (run,) = [r for r in await task_runs(flow_run_id, 1) if r.name == f"lease-j{job_id}-a1"]
    assert run.run_count == 1 and run.state is not None and run.state.is_failed()
    messages = await logs_of(run.id)
    rollback = [m for m in messages if m.startswith("rollback ")]
    assert len(rollback) == 1, messages
    assert f"job={job_id} lease=ci-lease-j{job_id}-a1-" in rollback[0]
    assert "undone=3 left=0 cause=ValidationFailed" in rollback[0]
    assert managed_on(fleet(emu.admin.dump())) == {}


async def test_decisions_are_grouped_and_a_lease_run_logs_its_line_in_its_final_state(
    emulator_factory, monkeypatch
) -> None:
    """A busy tick decides hundreds of jobs, and every Prefect record costs a console render and
    an API row: the admit and blocked lines come as one record of the flow run, and a lease
    task run's one record is Prefect's own "Finished in state", whose state message is the
    admitted line."""
    emu = emulator_factory({"a": 10})
    admitted = [
        emu.admin.add_job(job_labels(NODES, token=f"t{i}"), duration_s=600)["id"] for i in (1, 2)
    ]
    blocked = emu.admin.add_job(job_labels(NODES, token="t3"), duration_s=600)["id"]
    flow_run_id = await tick(emu, monkeypatch)

    leases = [r for r in await task_runs(flow_run_id, count=2) if r.name.startswith("lease-")]
    assert sorted(r.name for r in leases) == sorted(f"lease-j{job}-a1" for job in admitted)
    for run in leases:
        job = run.name.removeprefix("lease-j").removesuffix("-a1")
        assert run.state is not None and run.state.message is not None
        assert run.state.message.startswith(f"admitted job={job} lease=ci-lease-j{job}-a1-")
        (record,) = await logs_of(run.id)
        assert record == f"Finished in state Completed({run.state.message!r})"

    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
    flow_records = [log.message for log in logs if log.task_run_id is None]
    decisions = [m for m in flow_records if " job=" in m]
    assert len(decisions) == 1, flow_records
    lines = decisions[0].splitlines()
    assert lines[0] == "3 tick lines:"
    assert {line.split(" lease=")[0] for line in lines[1:]} == {
        *(f"admit job={job}" for job in admitted),
        f"blocked job={blocked}",
    }


async def test_a_batch_of_lease_task_runs_shares_one_verification_read(
    emulator_factory, monkeypatch
) -> None:
    """250 runners are 3 pages of the runner list. Two 4-node admissions verified alone read
    their 4 runners each (8 GETs); run side by side, as two lease task runs, one read of the
    list's 3 pages verifies both, after both runs' labels were answered."""
    emu = emulator_factory({"a": 250})
    jobs = [
        emu.admin.add_job(job_labels(NODES, token=f"t{i}"), duration_s=600)["id"] for i in (1, 2)
    ]
    emu.admin.reset_stats()
    flow_run_id = await tick(emu, monkeypatch)

    leases = [r for r in await task_runs(flow_run_id, count=2) if r.name.startswith("lease-")]
    assert sorted(r.name for r in leases) == sorted(f"lease-j{job}-a1" for job in jobs)
    assert all(r.state is not None and r.state.is_completed() for r in leases)
    assert all(r.run_count == 1 for r in leases)
    requests = emu.admin.stats()["requests"]
    assert requests.get("GET /repos/{owner}/{repo}/actions/runners/{runner_id}", 0) == 0
    # the snapshot's 3 pages, and the one shared read's 3
    assert requests["GET /repos/{owner}/{repo}/actions/runners"] == 3 + 3, requests
    assert len(managed_on(fleet(emu.admin.dump()))) == 2 * NODES
