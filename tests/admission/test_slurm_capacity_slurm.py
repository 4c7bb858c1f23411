"""Slurm as the capacity authority on the bundled cluster: four emulator runners of cluster:x are
partition debug's node[1-4]. Two nodes drained, held by an outside job, or reserved for someone
else block a 3-node job with that reason while a 2-node job is admitted; once Slurm gives them
back, the next tick admits the 3-node job. Every test gives the cluster back as it found it.

The invariant: a job slurmgate admits never waits in Slurm's queue for nodes the controller
believed free. Each admitted job's anchor allocates as the example workflow's step does (a
`salloc` named `sg-...`, the moment the emulator dispatches the job), and the time from that
dispatch to Slurm's grant is measured: it is the job's own startup (a `salloc` process), and
with runner-only capacity the same job waits in Slurm's queue instead."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flowcheck import jobs_by_id, wait_for

from slurmgate.admission.tick import TickReport, reconcile_tick
from slurmgate.controller.steps import direct_steps
from slurmgate.github.client import GitHubClient
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.admission import AdmissionSettings, PoolPartition
from slurmgate.settings.slurm import SlurmRestSettings
from slurmgate.slurm import commands as slurm
from slurmgate.slurm.capacity import read_pool_capacity
from slurmgate.slurm.slurmrestd import read_rest_capacity
from slurmgate.testbed.emulator.state import EmuJob
from slurmgate.testbed.emulator.testing import RunningEmulator, running_emulator

SETTINGS = AdmissionSettings(
    PRIORITY_SCHEDULER_ENABLED=True,
    NODE_SLOT_SCHEDULER_ENABLED=True,
    orphan_grace_s=0,
    pool_partitions={"x": "debug"},
)
HELD = "node[3-4]"
OUTSIDE_JOB = "outside-hold"
RESERVATION = "other-team"
ANCHOR_JOB = "sg-anchor-"  # the managed path's salloc name, as `allocation run` names it
# Dispatch to grant is one `salloc` process when Slurm has the nodes (0.006-0.015 s measured on
# the bundled cluster); the bound leaves room for a loaded CI machine, and a job Slurm cannot
# place waits the whole --immediate window (10 s) before salloc gives up.
STARTUP_BOUND_S = 2.0


def labels(token: str, score: str, nodes: int) -> list[str]:
    return ["self-hosted", "cluster:x", f"nodes:{nodes}", f"ci-job-{score}-{token}", "ci-attempt-1"]


def states() -> dict[str, str]:
    return slurm.sinfo_states()


def busy(*nodes: str) -> bool:
    """Every node runs a job (a one-CPU job leaves its node `mixed`)."""
    now = states()
    return all(now.get(n) in ("allocated", "mixed") for n in nodes)


def wait_idle(nodes: tuple[str, ...] = ("node1", "node2", "node3", "node4")) -> None:
    deadline = time.monotonic() + 60
    while not all(states().get(n) == "idle" for n in nodes):
        if time.monotonic() > deadline:
            raise AssertionError(f"nodes not idle after 60 s: {states()}")
        time.sleep(0.25)


@pytest.fixture
def cluster(slurm_cluster: dict[str, str]) -> Iterator[None]:
    """Four idle nodes before and after, whatever the test did to them."""
    wait_idle()
    try:
        yield
    finally:
        slurm.run(["scontrol", "update", f"nodename={HELD}", "state=resume"], check=False)
        slurm.scancel_by_name(OUTSIDE_JOB)
        slurm.run(["scontrol", "delete", f"reservation={RESERVATION}"], check=False)
        for job_id in anchor_jobs():
            slurm.scancel(job_id)
        wait_idle()


def anchor_jobs() -> list[str]:
    out = slurm.run(["squeue", "-h", "-o", "%i %j"], check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if f" {ANCHOR_JOB}" in line]


class Dispatches:
    """When the emulator hands each job to its anchor runner (GitHub's dispatch), by its clock."""

    def __init__(self, emu: RunningEmulator) -> None:
        self.at: dict[int, float] = {}
        self.changed = threading.Condition()
        emu.state.listeners.append(self.seen)

    def seen(self, action: str, job: EmuJob) -> None:
        if action == "in_progress":
            with self.changed:
                self.at.setdefault(job.id, time.time())
                self.changed.notify_all()

    def wait(self, job_id: int, timeout_s: float = 20.0) -> float:
        with self.changed:
            if not self.changed.wait_for(lambda: job_id in self.at, timeout=timeout_s):
                raise AssertionError(f"job {job_id} was not dispatched within {timeout_s} s")
            return self.at[job_id]


def anchor_allocates(dispatches: Dispatches, job_id: int, nodes: int) -> float:
    """What the anchor's step does once GitHub dispatched the job: ask Slurm for its nodes
    (`--immediate`, so a job Slurm cannot place fails instead of queueing), then give them back.
    Returns the seconds from dispatch to Slurm's grant."""
    dispatched = dispatches.wait(job_id)
    allocation = slurm.salloc_no_shell(
        nodes=nodes,
        job_name=f"{ANCHOR_JOB}{job_id}-{secrets.token_hex(4)}",
        partition="debug",
        time_limit="5",
        extra=("--immediate=10",),
        timeout=30,
    )
    granted = time.time()
    slurm.scancel(allocation)
    return granted - dispatched


def client_for(emu: RunningEmulator) -> GitHubClient:
    return GitHubClient(
        GitHubScope(api_url=emu.url, repo=emu.repo),
        emu.token,
        backoff_base_s=0.01,
        backoff_cap_s=0.02,
    )  # type: ignore[arg-type]


async def tick(emu: RunningEmulator) -> TickReport:
    async with client_for(emu) as client:
        return await reconcile_tick(direct_steps(client, settings=SETTINGS), SETTINGS)


async def blocked_then_admitted(give_back: str, why: str) -> None:
    """The scenario every test shares, once the test has taken node[3-4] away: the first tick
    admits the 2-node job and blocks the 3-node one naming `why`; `give_back` returns the nodes
    and, once the 2-node job has finished, the next tick admits the 3-node job. Each admitted
    job's anchor gets its nodes from Slurm as soon as it is dispatched."""
    with running_emulator({"x": 4}) as emu:
        dispatches = Dispatches(emu)
        wide = emu.admin.add_job(labels("wide", "5.000", 3), duration_s=0.3)["id"]
        narrow = emu.admin.add_job(labels("narrow", "1.000", 2), duration_s=0.3)["id"]
        first = await tick(emu)
        assert [a.job_id for a in first.decisions.admit] == [narrow]
        assert first.admitted == 1
        (blocked,) = first.decisions.blocked
        assert blocked.job_id == wide
        assert f"2 nodes {why} in partition debug: {HELD}" in blocked.line()
        (row,) = first.decisions.board_rows()
        assert row["slurm"] == (
            f"2/4 nodes usable in partition debug; 2 nodes {why} in partition debug: {HELD}"
        )
        waited = anchor_allocates(dispatches, narrow, 2)
        _give_back(give_back)
        done = lambda: jobs_by_id(emu.admin.dump())[narrow]["status"] == "completed"  # noqa: E731
        wait_for(done, timeout_s=20, what="the 2-node job to run and finish")
        second = await tick(emu)
        assert (second.released, [a.job_id for a in second.decisions.admit]) == (1, [wide])
        assert second.admitted == 1 and second.decisions.blocked == ()
        (row,) = second.decisions.board_rows()
        assert row["slurm"] == "4/4 nodes usable in partition debug"
        waited_wide = anchor_allocates(dispatches, wide, 3)
    print(f"dispatch -> grant ({give_back}): 2 nodes {waited:.3f} s, 3 nodes {waited_wide:.3f} s")
    assert 0 <= waited < STARTUP_BOUND_S and 0 <= waited_wide < STARTUP_BOUND_S


def _give_back(command: str) -> None:
    if command == "resume":
        slurm.run(["scontrol", "update", f"nodename={HELD}", "state=resume"])
    elif command == "scancel":
        slurm.scancel_by_name(OUTSIDE_JOB)
    elif command == "delete":
        slurm.run(["scontrol", "delete", f"reservation={RESERVATION}"])
    wait_idle()


async def test_drained_nodes_block_the_wide_job_until_they_are_resumed(cluster: None) -> None:
    slurm.run(["scontrol", "update", f"nodename={HELD}", "state=drain", "reason=slurmgate-test"])
    await blocked_then_admitted("resume", "drained")


async def test_an_outside_job_on_two_nodes_blocks_the_wide_job_until_it_ends(
    cluster: None,
) -> None:
    slurm.sbatch(
        ["-N2", f"-w{HELD}", f"-J{OUTSIDE_JOB}", "--time=5", "-o/dev/null", "--wrap=sleep 300"]
    )
    wait_for(
        lambda: busy("node3", "node4"),
        timeout_s=30,
        what="the outside job to hold node3 and node4",
    )
    # Slurm's end time for it (its 5-minute limit) is where capacity comes back
    (capacity,) = read_pool_capacity({"cluster:x": PoolPartition(partition="debug")}).values()
    ((end_s, nodes),) = capacity.returns
    assert nodes == 2 and 0 < end_s - time.time() <= 5 * 60
    await blocked_then_admitted("scancel", "held by jobs outside slurmgate")


async def test_a_reservation_for_someone_else_blocks_the_wide_job_until_it_is_deleted(
    cluster: None,
) -> None:
    slurm.run(
        [
            "scontrol",
            "create",
            "reservation",
            f"reservationname={RESERVATION}",
            f"nodes={HELD}",
            "starttime=now",
            "duration=10",
            "users=daemon",
        ]
    )
    await blocked_then_admitted("delete", f"reserved ({RESERVATION})")


async def test_with_runner_only_capacity_the_admitted_job_waits_in_slurms_queue(
    cluster: None,
) -> None:
    """The measurement's control: the same drained nodes, no partition mapped. The runners admit
    the 3-node job, and its anchor's allocation cannot start: Slurm has 2 nodes for it."""
    slurm.run(["scontrol", "update", f"nodename={HELD}", "state=drain", "reason=slurmgate-test"])
    runner_only = SETTINGS.model_copy(update={"pool_partitions": {}})
    with running_emulator({"x": 4}) as emu:
        dispatches = Dispatches(emu)
        wide = emu.admin.add_job(labels("wide", "5.000", 3), duration_s=600)["id"]
        emu.admin.add_job(labels("narrow", "1.000", 2), duration_s=600)
        async with client_for(emu) as client:
            report = await reconcile_tick(direct_steps(client, settings=runner_only), runner_only)
        assert [a.job_id for a in report.decisions.admit] == [wide]
        asked = time.monotonic()
        with pytest.raises(
            slurm.SlurmError, match=r"Immediate execution impossible|Unable to allocate"
        ):
            anchor_allocates(dispatches, wide, 3)
    assert time.monotonic() - asked >= STARTUP_BOUND_S  # it waited, then salloc gave up


async def test_a_managed_allocation_counts_as_ours_not_as_missing(cluster: None) -> None:
    """A job named like the runtime's salloc (`sg-...`) is the managed path: its nodes are not
    missing (its lease counts them), and no idle node is left for a new job."""
    slurm.sbatch(
        ["-N2", f"-w{HELD}", f"-J{OUTSIDE_JOB}", "--time=5", "-o/dev/null", "--wrap=sleep 300"]
    )
    managed = slurm.sbatch(
        ["-N2", "-wnode[1-2]", "-Jsg-test-0a1b2c3d", "--time=5", "-o/dev/null", "--wrap=sleep 300"]
    )
    try:
        wait_for(
            lambda: busy("node1", "node2", "node3", "node4"),
            timeout_s=30,
            what="both jobs running",
        )
        (capacity,) = read_pool_capacity({"cluster:x": PoolPartition(partition="debug")}).values()
        assert (capacity.idle, capacity.managed, capacity.usable) == (0, 2, 2)
        assert capacity.reasons() == [
            f"2 nodes held by jobs outside slurmgate in partition debug: {HELD}"
        ]
    finally:
        slurm.scancel(managed)


@pytest.fixture
def slurmrestd(cluster: None, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """slurmrestd (22.05's v0.0.38 plugin) on a unix socket with rest_auth/local, which trusts
    the socket's peer; its log records each request. Gives the URL and the log."""
    if shutil.which("slurmrestd") is None:
        pytest.skip("slurmrestd is not installed (Debian: apt-get install slurmrestd)")
    sock, log = tmp_path / "slurmrestd.sock", tmp_path / "slurmrestd.log"
    env = dict(os.environ)
    if os.geteuid() == 0:  # slurmrestd refuses root unless told; the test cluster runs as root
        env["SLURMRESTD_SECURITY"] = "disable_user_check"
    with log.open("w") as out:
        server = subprocess.Popen(
            ["slurmrestd", "-s", "v0.0.38", "-a", "rest_auth/local", f"unix:{sock}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_for(sock.exists, timeout_s=60, what="slurmrestd's socket")
        yield f"unix:{sock}", log
    finally:
        server.terminate()
        server.wait(timeout=10)


async def test_slurmrestd_reads_what_the_commands_read_and_the_tick_asks_it(
    slurmrestd: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drained, held by an outside job, reserved: slurmrestd's answers give each pool the same
    capacity as scontrol and squeue do. With $SLURMGATE_SLURMRESTD_URL set, the tick reads
    slurmrestd (its log has the requests) and blocks and admits as with the commands."""
    url, log = slurmrestd
    slurm.run(["scontrol", "update", "nodename=node4", "state=drain", "reason=slurmgate-test"])
    slurm.sbatch(
        ["-N1", "-wnode3", f"-J{OUTSIDE_JOB}", "--time=5", "-o/dev/null", "--wrap=sleep 300"]
    )
    slurm.run(
        [
            "scontrol",
            "create",
            "reservation",
            f"reservationname={RESERVATION}",
            "nodes=node2",
            "starttime=now",
            "duration=10",
            "users=daemon",
        ]
    )
    wait_for(lambda: busy("node3"), timeout_s=30, what="the outside job to hold node3")
    pools = {"cluster:x": PoolPartition(partition="debug")}
    by_rest = read_rest_capacity(SlurmRestSettings(url=url), pools)
    assert by_rest == read_pool_capacity(pools)
    assert by_rest["cluster:x"].reasons() == [
        "1 node drained in partition debug: node4",
        "1 node held by jobs outside slurmgate in partition debug: node3",
        f"1 node reserved ({RESERVATION}) in partition debug: node2",
    ]
    slurm.scancel_by_name(OUTSIDE_JOB)
    slurm.run(["scontrol", "delete", f"reservation={RESERVATION}"])
    slurm.run(["scontrol", "update", "nodename=node4", "state=resume"])
    wait_idle()
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", url)
    slurm.run(["scontrol", "update", f"nodename={HELD}", "state=drain", "reason=slurmgate-test"])
    asked = log.read_text().count("GET /slurm/v0.0.38/nodes")
    await blocked_then_admitted("resume", "drained")
    # one read a snapshot: the first tick's, the second tick's and its re-read after the release
    assert log.read_text().count("GET /slurm/v0.0.38/nodes") == asked + 3


def test_status_shows_what_slurm_lacks(cluster: None) -> None:
    from test_slurm_capacity import _status

    slurm.run(["scontrol", "update", f"nodename={HELD}", "state=drain", "reason=slurmgate-test"])
    with running_emulator({"x": 4}) as emu:
        out = _status(emu.url, emu.repo, emu.token, {})
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr
    assert f"2 nodes drained in partition debug: {HELD}" in out.stdout
    assert "2/4 nodes usable in partition debug" in out.stdout


async def test_the_reconcile_flow_admits_on_slurm_capacity_and_its_board_says_why(
    cluster: None,
    prefect_harness: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: object,
) -> None:
    """The Prefect flow wires the same read: the board artifact names the drained nodes."""
    from prefect.artifacts import Artifact

    from slurmgate.flows.reconcile import BOARD_KEY, reconcile

    env = {
        "PRIORITY_SCHEDULER_ENABLED": "true",
        "NODE_SLOT_SCHEDULER_ENABLED": "true",
        "SLURMGATE_POOL_PARTITIONS": '{"x": {"partition": "debug"}}',
        "SLURMGATE_MIN_WRITE_INTERVAL_S": "0",
        "SLURMGATE_ORPHAN_GRACE_S": "0",
        "SLURMGATE_STATE_DIR": f"{tmp_path}/state",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    slurm.run(["scontrol", "update", f"nodename={HELD}", "state=drain", "reason=slurmgate-test"])
    with running_emulator({"x": 4}) as emu:
        monkeypatch.setenv("GITHUB_TOKEN", emu.token)
        wide = emu.admin.add_job(labels("wide", "5.000", 3), duration_s=600)["id"]
        emu.admin.add_job(labels("narrow", "1.000", 2), duration_s=600)
        summary = await reconcile(
            scope_block=None, api_url=emu.url, repo=emu.repo, reap_allocations=False
        )
        assert (summary["admitted"], summary["blocked"], summary["errors"]) == (1, 1, 0)
        board = await Artifact.aget(BOARD_KEY)
        assert board is not None
        text = str(board.data)
        assert f"job {wide} (3n): no-free-capacity" in text
        assert f"2 nodes drained in partition debug: {HELD}" in text
