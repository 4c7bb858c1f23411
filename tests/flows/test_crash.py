"""Crash consistency: SIGKILL the controller between protocol steps; the next tick repairs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from flowcheck import assert_invariants, fleet, job_labels, jobs_by_id, lease_of_job, managed_on

from slurmgate.flows.reconcile import reconcile

NODES = 10


def controller(emu: Any) -> subprocess.Popen[bytes]:
    """`slurmgate reconcile --once` in its own process, against this session's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "GITHUB_TOKEN": emu.token, "PREFECT_API_URL": PREFECT_API_URL.value()}
    args = ["reconcile", "--once", "--api-url", emu.url, "--repo", emu.repo]
    return subprocess.Popen(
        [sys.executable, "-m", "slurmgate.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def kill_when_hanging(proc: subprocess.Popen[bytes], emu: Any, k: int) -> None:
    """Wait until the controller's k-th write hangs in the emulator, then SIGKILL it."""
    deadline = time.monotonic() + 60
    while emu.admin.stats()["writes"] < k:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise AssertionError(f"controller exited {proc.returncode} before write {k}: {err}")
        assert time.monotonic() < deadline, f"write {k} never came"
        time.sleep(0.05)
    time.sleep(0.2)  # let an applied=True write land before the kill
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


# Each point between protocol steps (a kill costs a fresh controller process, ~5 s):
# inside step 1 after the 1st, 2nd, 5th and 9th label landed; after step 1 (all 10 landed,
# verify not run); after step 2 (verified, the anchor write never landed); after step 3 (the
# anchor landed but the controller died before it could record anything).
POINTS = [(1, True), (2, True), (5, True), (9, True), (10, True), (11, False), (11, True)]


@pytest.mark.parametrize(("k", "applied"), POINTS)
async def test_kill_between_steps_is_repaired(k, applied, emulator_factory, monkeypatch) -> None:
    emu = emulator_factory({"a": 12})
    job_id = emu.admin.add_job(job_labels(NODES), duration_s=600)["id"]
    emu.admin.reset_stats()
    emu.admin.fault("hang_nth_write", n=k, hang_s=30, applied=applied)

    kill_when_hanging(controller(emu), emu, k)
    crashed = fleet(emu.admin.dump())
    landed = k if applied else k - 1
    assert len(lease_of_job(crashed, job_id)) == min(landed, NODES)  # what the crash left
    assert bool(managed_on([r for r in crashed if r.managed_job_labels()])) == (landed > NODES)

    monkeypatch.setenv("GITHUB_TOKEN", emu.token)
    for _ in range(2):
        summary = await reconcile(scope_block=None, api_url=emu.url, repo=emu.repo)
        assert summary["errors"] == 0
        assert_invariants(emu.admin.dump())
        if len(lease_of_job(fleet(emu.admin.dump()), job_id)) == NODES:
            break
    dump = emu.admin.dump()
    assert len(lease_of_job(fleet(dump), job_id)) == NODES, "job not admitted after 2 ticks"
    assert len(managed_on(fleet(dump))) == NODES  # no stray label anywhere
    assert jobs_by_id(dump)[job_id]["status"] == "in_progress"
