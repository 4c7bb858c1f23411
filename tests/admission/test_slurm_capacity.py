"""Slurm as the capacity authority, without Slurm: the capacity maths, the reason wording, what
the adapter reads from Slurm's own text, the settings, and the tick's fail-open read."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from admission_kit import NOW, admitted, blocked, job, lease_runners, pool, snapshot
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from slurmgate.admission.capacity import MissingNodes, NodeCapacity, compact_hostlist
from slurmgate.admission.leases import RemovalOutcome
from slurmgate.admission.model import BlockReason, JobStatus, Snapshot
from slurmgate.admission.planner import plan
from slurmgate.admission.tick import TickSteps, reconcile_tick
from slurmgate.controller.steps import slurm_capacity_step
from slurmgate.settings.admission import AdmissionSettings, PoolPartition
from slurmgate.slurm.capacity import (
    HELD_OUTSIDE,
    expand_hostlist,
    is_managed_job,
    node_capacity,
    parse_jobs,
    parse_nodes,
    parse_reservations,
    read_pool_capacity,
)
from slurmgate.slurm.commands import SlurmError


def cfg(**knobs: Any) -> AdmissionSettings:
    return AdmissionSettings.model_validate(
        {
            "PRIORITY_SCHEDULER_ENABLED": True,
            "NODE_SLOT_SCHEDULER_ENABLED": True,
            "estimates": "timeout",
            "reserve_after_s": 0,
            "pool_partitions": {"x": "debug"},
            **knobs,
        }
    )


DRAINED = NodeCapacity("debug", idle=2, missing=(MissingNodes("drained", ("node3", "node4")),))


# ---- node lists ------------------------------------------------------------------------------


def test_node_lists_fold_into_slurm_ranges_and_expand_back() -> None:
    names = ["node1", "node2", "node3", "node7", "node10", "gpu08", "gpu09", "login"]
    assert compact_hostlist(names) == "gpu[08-09],login,node[1-3,7,10]"
    assert compact_hostlist(["node4"]) == "node4"
    assert sorted(expand_hostlist("gpu[08-09],login,node[1-3,7,10]")) == sorted(names)
    assert expand_hostlist("a-[01-02]b,c") == ["a-01b", "a-02b", "c"]


@given(st.sets(st.integers(min_value=0, max_value=300), min_size=1, max_size=40))
def test_compact_then_expand_is_the_same_set(numbers: set[int]) -> None:
    names = {f"node{n}" for n in numbers}
    assert set(expand_hostlist(compact_hostlist(names))) == names


# ---- the capacity maths ----------------------------------------------------------------------


def test_drained_nodes_block_the_wide_job_with_their_names_while_a_narrow_one_fits() -> None:
    snap = snapshot(pool("x", 4), [job(1, 3, score="5.000"), job(2, 2, score="1.000")])
    d = plan(snap, cfg(), NOW, slurm={"cluster:x": DRAINED})
    assert admitted(d) == {2: 2}
    assert blocked(d) == {1: BlockReason.NO_CAPACITY}
    (wide,) = d.blocked
    assert "2 nodes drained in partition debug: node[3-4]" in wide.detail
    assert "Slurm can give 2" in wide.line()
    (row,) = d.board_rows()
    assert (
        row["slurm"]
        == "2/4 nodes usable in partition debug; 2 nodes drained in partition debug: node[3-4]"
    )
    # without Slurm's word the runners alone would have taken the wide job
    assert admitted(plan(snap, cfg(), NOW)) == {1: 3}


def test_unmapped_pools_and_an_unread_slurm_count_runners_only() -> None:
    snap = snapshot(pool("x", 4) + pool("y", 4, start=5), [job(1, 4, pool_name="y")])
    d = plan(snap, cfg(), NOW, slurm={"cluster:x": NodeCapacity("debug", idle=0)})
    assert admitted(d) == {1: 4}
    assert {r["pool"]: r["slurm"] for r in d.board_rows()} == {
        "cluster:x": "0/0 nodes usable in partition debug",
        "cluster:y": "",
    }


@pytest.mark.parametrize(
    ("leased", "idle", "managed", "room"),
    [
        (0, 4, 0, 4),  # all idle
        (2, 4, 0, 2),  # a lease whose job has not allocated yet holds two idle nodes
        (2, 2, 2, 2),  # the lease's job allocated its two nodes: they are ours, not missing
        (0, 2, 2, 2),  # a managed allocation without a lease frees no idle node
        (2, 1, 2, 1),  # one node went elsewhere
        (0, 0, 0, 0),
    ],
)
def test_usable_capacity_is_the_smaller_of_free_runners_and_slurm_nodes(
    leased: int, idle: int, managed: int, room: int
) -> None:
    runners = pool("x", 4)
    jobs = [job(50, 2, status="in_progress")] if leased else []  # type: ignore[arg-type]
    if leased:
        runners = lease_runners(runners, jobs[0], [1, 2])
    snap = snapshot(runners, [*jobs, *(job(i, 1) for i in range(1, 5))])
    missing = 4 - idle - managed
    capacity = NodeCapacity(
        "debug",
        idle=idle,
        managed=managed,
        missing=(MissingNodes("down", tuple(f"n{i}" for i in range(missing))),) if missing else (),
    )
    d = plan(snap, cfg(), NOW, slurm={"cluster:x": capacity})
    assert sum(admitted(d).values()) == room


@given(
    idle=st.integers(0, 6),
    managed=st.integers(0, 6),
    leased=st.integers(0, 3),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    policy=st.sampled_from(["greedy", "easy", "conservative"]),
)
def test_no_plan_admits_more_than_slurm_can_give(
    idle: int, managed: int, leased: int, sizes: list[int], policy: str
) -> None:
    runners = pool("x", 6)
    running = job(99, leased, status="in_progress") if leased else None  # type: ignore[arg-type]
    if running is not None:
        runners = lease_runners(runners, running, list(range(1, leased + 1)))
    queued = [job(i, n) for i, n in enumerate(sizes, start=1)]
    snap = snapshot(runners, [*queued, *([running] if running else [])])
    capacity = NodeCapacity("debug", idle=idle, managed=managed)
    d = plan(snap, cfg(policy=policy), NOW, slurm={"cluster:x": capacity})
    taken = sum(admitted(d).values())
    assert taken <= max(0, min(idle, idle + managed - leased))


@pytest.mark.parametrize("policy", ["easy", "conservative"])
def test_reservations_are_made_at_the_end_slurm_reports_for_an_outside_job(policy: str) -> None:
    """Two nodes are held by an outside job that Slurm says ends in 600 s: the 4-node top job
    is reserved then, and an 8-hour 2-node job may not start in front of it."""
    held = NodeCapacity(
        "debug",
        idle=2,
        missing=(MissingNodes(HELD_OUTSIDE, ("node3", "node4")),),
        returns=((NOW.timestamp() + 600, 2),),
    )
    snap = snapshot(pool("x", 4), [job(1, 4, score="5.000"), job(2, 2, score="1.000")])
    d = plan(snap, cfg(policy=policy), NOW, slurm={"cluster:x": held})
    assert admitted(d) == {}
    reasons = {b.job_id: b for b in d.blocked}
    assert "reserved cluster:x in 600s" in reasons[1].detail
    assert "held by jobs outside slurmgate in partition debug: node[3-4]" in reasons[1].detail
    assert reasons[2].reason == BlockReason.RESERVED
    # an outside job without an end Slurm can promise: no reservation, the 2-node job backfills
    unknown = NodeCapacity("debug", idle=2, missing=held.missing)
    d = plan(snap, cfg(policy=policy), NOW, slurm={"cluster:x": unknown})
    assert admitted(d) == {2: 2}


# ---- what Slurm says, as its commands print it -----------------------------------------------

NODES = "\n".join(
    f"NodeName={name} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 AvailableFeatures={features} "
    f"ActiveFeatures={features} OS=Linux 6.1 #1 SMP State={state} Partitions={parts} "
    f"Reason={reason}"
    for name, state, parts, features, reason in [
        ("node1", "IDLE", "debug", "(null)", "(null)"),
        ("node2", "MIXED", "debug", "(null)", "(null)"),
        ("node3", "IDLE+DRAIN", "debug", "(null)", "maint [root@2026-12-02T12:00:00]"),
        ("node4", "ALLOCATED+DRAIN", "debug", "(null)", "x"),
        ("node5", "DOWN+NOT_RESPONDING", "debug,gpu", "mi300x", "(null)"),
        ("node6", "IDLE+RESERVED", "debug,gpu", "mi300x", "(null)"),
        ("node7", "ALLOCATED", "debug,gpu", "mi300x", "(null)"),
        ("node8", "IDLE+MAINT+RESERVED", "gpu", "mi300x,ib", "(null)"),
        ("node9", "IDLE", "gpu", "h100", "(null)"),
        ("node10", "IDLE", "gpu", "mi300x", "(null)"),
    ]
)
RESERVATIONS = (
    "ReservationName=other StartTime=2026-12-02T12:00:00 EndTime=2026-12-02T13:00:00 "
    "Duration=01:00:00 Nodes=node[6,10] NodeCnt=2 CoreCnt=16 Features=(null) "
    "PartitionName=(null) Flags=SPEC_NODES Users=daemon Accounts=(null) State=ACTIVE\n"
    "ReservationName=later StartTime=2027-01-01T00:00:00 EndTime=2027-01-02T00:00:00 "
    "Nodes=node1 State=INACTIVE\n"
    "ReservationName=maint StartTime=2026-12-02T12:00:00 EndTime=INFINITE Nodes=node8 "
    "Flags=MAINT,SPEC_NODES State=ACTIVE\n"
)
SEP = "\x1f"
JOBS = "\n".join(
    SEP.join(fields)
    for fields in [
        ("101", "2026-12-02T12:30:00", "node2", "sg-demo-1a2b3c4d", "(null)"),
        ("102", "Unknown", "node4", "sg-demo-ffff0000", "(null)"),
        ("103", "2026-12-02T12:45:00", "node7", "someone|else", "a note"),
        ("104", "2026-12-02T12:50:00", "node[9-10]", "wrapped", "by slurmgate"),
    ]
)


def test_the_adapter_reads_node_states_reservations_and_jobs_as_slurm_prints_them() -> None:
    nodes, reservations, jobs = (
        parse_nodes(NODES),
        parse_reservations(RESERVATIONS),
        parse_jobs(JOBS),
    )
    assert [r.name for r in reservations] == ["other", "maint"]  # the inactive one holds nothing
    assert [(j.job_id, j.managed) for j in jobs] == [
        ("101", True), ("102", True), ("103", False), ("104", True)
    ]  # fmt: skip
    assert jobs[3].nodes == ("node9", "node10")
    debug = node_capacity(PoolPartition(partition="debug"), nodes, reservations, jobs)
    assert (debug.idle, debug.managed) == (1, 1)  # node1; node2 runs sg-demo-...
    assert debug.reasons() == [
        "1 node down in partition debug: node5",
        "1 node drained in partition debug: node3",
        "1 node draining in partition debug: node4",
        f"1 node {HELD_OUTSIDE} in partition debug: node7",
        "1 node reserved (other) in partition debug: node6",
    ]
    # node7 comes back when job 103 ends, node6 when the reservation ends
    assert [n for _, n in debug.returns] == [1, 1]
    mi300 = node_capacity(
        PoolPartition(partition="gpu", feature="mi300x"), nodes, reservations, jobs
    )
    assert (mi300.idle, mi300.managed, mi300.total) == (0, 0, 5)  # node9 is an h100
    assert "1 node in maintenance in partition gpu: node8" in mi300.reasons()
    assert "2 nodes reserved (other) in partition gpu: node[6,10]" in mi300.reasons()
    inside = node_capacity(
        PoolPartition(partition="gpu", feature="mi300x", reservation="other"),
        nodes,
        reservations,
        jobs,
    )
    # in the pool's own reservation: node6 is idle, node10 runs job 104 (commented slurmgate)
    assert (inside.idle, inside.managed) == (1, 1)
    assert "1 node outside reservation other in partition gpu: node7" in inside.reasons()
    nowhere = node_capacity(PoolPartition(partition="nope"), nodes, reservations, jobs)
    assert nowhere.usable == 0
    assert "partition nope has no node in Slurm" in nowhere.summary()


def test_managed_jobs_are_named_by_the_runtime_or_commented() -> None:
    assert is_managed_job("sg-llama-0a1b2c3d")
    assert is_managed_job("anything", "run by SlurmGate")
    assert not is_managed_job("sgx-other", "")


# ---- settings --------------------------------------------------------------------------------


def test_pool_partitions_come_from_the_environment_as_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "SLURMGATE_POOL_PARTITIONS",
        '{"MI300": {"partition": "gpu", "feature": "mi300x", "reservation": null}, '
        '"cluster:x": "debug"}',
    )
    assert AdmissionSettings().pool_partitions == {
        "cluster:mi300": PoolPartition(partition="gpu", feature="mi300x"),
        "cluster:x": PoolPartition(partition="debug"),
    }
    monkeypatch.setenv("SLURMGATE_POOL_PARTITIONS", '{"x": {"partiton": "gpu"}}')
    with pytest.raises(ValidationError, match=re.escape("pool_partitions.cluster:x.partition")):
        AdmissionSettings()
    monkeypatch.setenv("SLURMGATE_POOL_PARTITIONS", '{"a b": "gpu"}')
    with pytest.raises(ValidationError, match="pool_partitions key 'a b' must be a pool name"):
        AdmissionSettings()


def test_the_policy_block_carries_pool_partitions() -> None:
    from slurmgate.blocks import AdmissionPolicyBlock

    block = AdmissionPolicyBlock(
        priority_scheduler_enabled=True,
        pool_partitions={"mi300": {"partition": "gpu", "reservation": "ci"}},
    )
    settings = block.to_settings()
    assert settings.pool_partitions == {
        "cluster:mi300": PoolPartition(partition="gpu", reservation="ci")
    }
    assert AdmissionPolicyBlock.from_settings(settings).to_settings() == settings


# ---- fail-open -------------------------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def _logger() -> tuple[logging.Logger, Lines]:
    log = logging.getLogger(f"slurm-capacity-test-{os.getpid()}-{id(object())}")
    log.propagate = False
    handler = Lines()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return log, handler


async def _tick_with(read_capacity: Any, settings: AdmissionSettings) -> tuple[Any, Lines]:
    """A tick over 6 runners: a finished job's lease on two of them is released first, so
    the tick reads (and asks Slurm) twice; then a 3-node job is placed."""
    done = job(7, 2, status=JobStatus.COMPLETED)
    first = snapshot(lease_runners(pool("x", 6), done, [5, 6]), [done, job(1, 3)])
    reads = [first, snapshot(pool("x", 6), [done, job(1, 3)])]

    async def read() -> Snapshot:
        return reads.pop(0) if len(reads) > 1 else reads[0]

    async def remove(pairs: Sequence[tuple[int, Sequence[str]]]) -> RemovalOutcome:
        return RemovalOutcome(tuple((rid, x) for rid, labels in pairs for x in labels), ())

    log, lines = _logger()
    steps = TickSteps(read, remove=remove, read_capacity=read_capacity)
    report = await reconcile_tick(steps, settings, log=log)
    assert report.released == 1
    return report, lines


async def test_slurm_not_answering_falls_back_to_runner_only_capacity_with_one_warning() -> None:
    calls = 0

    async def broken() -> dict[str, NodeCapacity]:
        nonlocal calls
        calls += 1
        raise SlurmError(["scontrol", "show", "node", "-o"], "timed out after 10 s")

    report, lines = await _tick_with(broken, cfg())
    assert admitted(report.decisions) == {1: 3}  # fail-open: the runners decide
    warnings = [msg for level, msg in lines.lines if level == logging.WARNING]
    assert warnings == [
        "slurm capacity unread (SlurmError: `scontrol show node -o` timed out after 10 s): "
        "this tick counts runners only"
    ]
    assert calls == 1  # not asked again after it failed: the re-read counts runners too


async def test_a_missing_slurm_client_or_configuration_fails_open_through_the_real_adapter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = cfg()
    step = slurm_capacity_step(settings)
    assert step is not None and slurm_capacity_step(cfg(pool_partitions={})) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol, no sinfo
    with pytest.raises(SlurmError, match="not found: install the Slurm client"):
        read_pool_capacity(settings.pool_partitions)
    report, lines = await _tick_with(step, settings)
    assert admitted(report.decisions) == {1: 3}
    assert next(m for lvl, m in lines.lines if lvl == logging.WARNING).startswith(
        "slurm capacity unread (SlurmError: `scontrol show node -o` not found"
    )
    monkeypatch.undo()
    if shutil.which("scontrol") is None:
        pytest.skip("the Slurm client is not installed: no dead controller to ask")
    # a configuration whose controller nobody serves (port 9, discard): Slurm answers
    # "Unable to contact slurm controller" in about a second
    dead = tmp_path / "slurm.conf"
    dead.write_text(
        "ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
        "MessageTimeout=2\nNodeName=n1 CPUs=1\nPartitionName=debug Nodes=n1\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(dead))
    report, lines = await _tick_with(step, settings)
    assert admitted(report.decisions) == {1: 3}
    (warning,) = [m for lvl, m in lines.lines if lvl == logging.WARNING]
    assert "Unable to contact slurm controller" in warning


def test_the_demo_summary_says_how_long_slurm_took_to_grant_the_allocation() -> None:
    from slurmgate.testbed.demo import RuntimeResult, summary_lines

    rt = RuntimeResult(run_id="sg-demo-1", job_id="7", hosts=["node1", "node2"])
    assert not any("allocation:" in line for line in summary_lines(None, rt, 1.0))
    rt.allocation_wait_s = 0.0123
    assert "  allocation: Slurm granted its 2 node(s) 0.012 s after salloc asked" in summary_lines(
        None, rt, 1.0
    )


def test_the_demo_board_shows_why_slurm_capacity_is_missing() -> None:
    from slurmgate.testbed.board import AdmissionTracker, render_compact, render_live

    snap = snapshot(pool("x", 4), [job(1, 3, score="5.000")])
    rows = plan(snap, cfg(), NOW, slurm={"cluster:x": DRAINED}).board_rows()
    dump = {
        "runners": [
            {"id": r.id, "status": "online", "labels": [{"name": x} for x in r.labels]}
            for r in snap.runners
        ],
        "jobs": [{"id": 1, "status": "queued", "labels": list(snap.jobs[0].labels)}],
    }
    view = AdmissionTracker().observe(1, dump, rows)
    said = (
        "slurm: 2/4 nodes usable in partition debug; 2 nodes drained in partition debug: node[3-4]"
    )
    compact = render_compact(view).splitlines()
    assert compact[1].endswith("blocked: 1:3n:no-free-capacity")
    assert compact[2] == f"    {said}"
    table = render_live(view, []).renderables[0]
    assert said in str(table.columns[-1]._cells[0])  # type: ignore[attr-defined]


def _status(emu_url: str, repo: str, token: str, env: dict[str, str]) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "slurmgate.cli", "status", "--api-url", emu_url, "--repo", repo],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "GITHUB_TOKEN": token,
            "PRIORITY_SCHEDULER_ENABLED": "true",
            "NODE_SLOT_SCHEDULER_ENABLED": "true",
            "SLURMGATE_POOL_PARTITIONS": '{"x": "debug"}',
            "COLUMNS": "200",
            **env,
        },
        check=False,
    )


def test_status_warns_once_and_shows_runner_capacity_when_slurm_does_not_answer(
    tmp_path: Path,
) -> None:
    from slurmgate.testbed.emulator.testing import running_emulator

    if shutil.which("scontrol") is None:
        pytest.skip("the Slurm client is not installed: no dead controller to ask")
    dead = tmp_path / "slurm.conf"
    dead.write_text(
        "ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
        "MessageTimeout=2\nNodeName=n1 CPUs=1\nPartitionName=debug Nodes=n1\n"
    )
    with running_emulator({"x": 4}) as emu:
        out = _status(emu.url, emu.repo, emu.token, {"SLURM_CONF": str(dead)})
    assert out.returncode == 0, out.stderr
    (warning,) = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert "slurm capacity unread" in warning and "this tick counts runners only" in warning
    assert "cluster:x" in out.stdout and "usable" not in out.stdout  # runner capacity only


# ---- slurmrestd ------------------------------------------------------------------------------

# As slurmrestd 22.05 (plugin v0.0.38) answered on the bundled cluster with node[3-4] drained,
# node2 running an outside batch job and node1 reserved for another user (trimmed to the fields
# read; the tests on the bundled cluster ask a real slurmrestd).
REST_NODES = {
    "errors": [],
    "nodes": [
        {"name": "node1", "state": "idle", "state_flags": [], "partitions": ["debug"],
         "features": ""},
        {"name": "node2", "state": "mixed", "state_flags": [], "partitions": ["debug"],
         "features": ""},
        {"name": "node3", "state": "idle", "state_flags": ["DRAIN"], "partitions": ["debug"],
         "features": ""},
        {"name": "node4", "state": "idle", "state_flags": ["DRAIN"], "partitions": ["debug"],
         "features": ""},
    ],
}  # fmt: skip
REST_RESERVATIONS = {
    "errors": [],
    "reservations": [
        {"name": "probe", "node_list": "node1", "flags": ["SPEC_NODES"], "users": "daemon",
         "start_time": 1796235234, "end_time": 1796235834},
        {"name": "later", "node_list": "node2", "start_time": 1896235234, "end_time": 1896236000},
    ],
}  # fmt: skip
REST_JOBS = {
    "errors": [],
    "jobs": [
        {"job_id": 1, "job_state": "RUNNING", "name": "outside", "comment": "a note",
         "nodes": "node2", "end_time": 1796235534},
        {"job_id": 2, "job_state": "PENDING", "name": "waiting", "comment": "", "nodes": "",
         "end_time": 0},
        {"job_id": 3, "job_state": "COMPLETED", "name": "sg-old-00000000", "comment": "",
         "nodes": "node3", "end_time": 1796230000},
    ],
}  # fmt: skip


def test_slurmrestd_answers_read_as_the_commands_read() -> None:
    from slurmgate.slurm.slurmrestd import (
        parse_rest_jobs,
        parse_rest_nodes,
        parse_rest_reservations,
    )

    nodes = parse_rest_nodes(REST_NODES)
    reservations = parse_rest_reservations(REST_RESERVATIONS, now=1796235300)
    jobs = parse_rest_jobs(REST_JOBS)
    assert [r.name for r in reservations] == ["probe"]  # "later" has not started
    assert [(j.job_id, j.nodes, j.end_s) for j in jobs] == [("1", ("node2",), 1796235534.0)]
    debug = node_capacity(PoolPartition(partition="debug"), nodes, reservations, jobs)
    assert (debug.idle, debug.managed, debug.usable) == (0, 0, 0)
    assert debug.reasons() == [
        "2 nodes drained in partition debug: node[3-4]",
        f"1 node {HELD_OUTSIDE} in partition debug: node2",
        "1 node reserved (probe) in partition debug: node1",
    ]
    assert sorted(n for _, n in debug.returns) == [1, 1]  # the job's end, the reservation's end


def test_later_slurmrestd_plugins_states_as_lists_and_times_as_objects() -> None:
    """v0.0.39 on: a node's state is a list of words, times are {set, infinite, number}."""
    from slurmgate.slurm.slurmrestd import parse_rest_jobs, parse_rest_nodes

    nodes = parse_rest_nodes(
        {
            "nodes": [
                {"name": "g1", "state": ["IDLE", "DRAIN"], "partitions": ["gpu"],
                 "features": ["mi300x", "ib"]},
                {"name": "g2", "state": ["MIXED"], "partitions": ["gpu"], "features": ["mi300x"]},
                {"name": "g3", "state": ["IDLE"], "partitions": ["gpu"], "features": ["h100"]},
                {"state": ["IDLE"]},  # no name: not a node
            ]
        }
    )  # fmt: skip
    jobs = parse_rest_jobs(
        {
            "jobs": [
                {"job_id": 7, "job_state": ["RUNNING"], "name": "sg-x-01234567",
                 "comment": {"job": "", "system": ""}, "nodes": "g2",
                 "end_time": {"set": True, "infinite": False, "number": 1796235534}},
                {"job_id": 8, "job_state": ["RUNNING"], "name": "w",
                 "comment": {"job": "by slurmgate"}, "nodes": "g3",
                 "end_time": {"set": True, "infinite": True, "number": 0}},
            ]
        }
    )  # fmt: skip
    assert [(n.name, n.base, n.flags) for n in nodes] == [
        ("g1", "IDLE", frozenset({"DRAIN"})),
        ("g2", "MIXED", frozenset()),
        ("g3", "IDLE", frozenset()),
    ]
    assert [(j.managed, j.end_s) for j in jobs] == [(True, 1796235534.0), (True, None)]
    mi300 = node_capacity(PoolPartition(partition="gpu", feature="mi300x"), nodes, [], jobs)
    assert (mi300.idle, mi300.managed, mi300.reasons()) == (
        0,
        1,
        ["1 node drained in partition gpu: g1"],
    )


def test_slurmrestd_settings_name_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slurmgate.settings.slurm import SlurmRestSettings

    assert SlurmRestSettings().url is None
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "unix:/run/slurmrestd.sock")
    assert SlurmRestSettings().url == "unix:/run/slurmrestd.sock"
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "https://slurm.example.org:6820/")
    assert SlurmRestSettings().url == "https://slurm.example.org:6820"
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "ftp://slurm")
    with pytest.raises(ValidationError, match="give http\\(s\\)://host:port or unix:/path"):
        SlurmRestSettings()
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_TOKEN", "eyJ-secret")
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "http://slurm.example.org:6820")
    with pytest.raises(ValidationError, match="would cross the network in clear") as caught:
        SlurmRestSettings()
    assert "eyJ-secret" not in str(caught.value)
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "http://127.0.0.1:6820")
    assert SlurmRestSettings().url == "http://127.0.0.1:6820"
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "unix:/run/slurmrestd.sock")
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_API_VERSION", "latest")
    with pytest.raises(ValidationError, match=re.escape("give one like v0.0.38")):
        SlurmRestSettings()


async def test_slurmrestd_not_answering_fails_open_with_one_warning_and_no_token(
    tmp_path: Path,
) -> None:
    from pydantic import SecretStr

    from slurmgate.settings.slurm import SlurmRestSettings

    token = "eyJhbGciOiJIUzI1NiJ9.slurm-token-secret"
    rest = SlurmRestSettings(
        url=f"unix:{tmp_path / 'no-such.sock'}", user="ci", token=SecretStr(token)
    )
    step = slurm_capacity_step(cfg(), rest)
    assert step is not None
    report, lines = await _tick_with(step, cfg())
    assert admitted(report.decisions) == {1: 3}  # runner-only capacity
    (warning,) = [m for lvl, m in lines.lines if lvl == logging.WARNING]
    assert warning.startswith(
        f"slurm capacity unread (SlurmError: `slurmrestd GET unix:{tmp_path}/no-such.sock"
        "/slurm/v0.0.38/nodes` failed (ConnectError)"
    )
    assert token not in warning and "slurm-token-secret" not in warning


async def test_a_misconfigured_slurmrestd_is_a_warning_each_tick_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_URL", "ftp://slurm")
    monkeypatch.setenv("SLURMGATE_SLURMRESTD_TIMEOUT_S", "0")
    step = slurm_capacity_step(cfg())
    assert step is not None
    report, lines = await _tick_with(step, cfg())
    assert admitted(report.decisions) == {1: 3}
    assert [m for lvl, m in lines.lines if lvl == logging.WARNING] == [
        "slurm capacity unread (SlurmRestConfigError: SLURMGATE_SLURMRESTD_URL 'ftp://slurm' is "
        "not slurmrestd's address; give http(s)://host:port or unix:/path/to/socket; "
        "SLURMGATE_SLURMRESTD_TIMEOUT_S: Input should be greater than 0): this tick counts "
        "runners only"
    ]
