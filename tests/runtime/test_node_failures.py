"""Node-failure policy (which node a failed run blames, whether it retries) and the reaper's
choice of other users' runs: pure, no Slurm."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgate.runtime.ledger import heartbeat
from slurmgate.runtime.ledger.comment import (
    JOB_COMMENT_PREFIX,
    ProcessIdentity,
    job_comment,
    parse_job_comment,
)
from slurmgate.runtime.ledger.reaper import foreign_stale_allocations
from slurmgate.runtime.ledger.records import NodeFailure, RunRecord
from slurmgate.runtime.run.node_failures import (
    LANE_CRASH_MIN_UPTIME_S,
    NodeFailureSettingError,
    NodeFailureSettings,
    StepOutcome,
    blame,
    drain_reason,
    retry_decision,
)
from slurmgate.runtime.steps import protocol
from slurmgate.slurm import commands as slurm

NODES = [f"node{i}" for i in range(1, 7)]


def _ok(host: str) -> str:
    return protocol.encode(protocol.PreflightPassed(host=host, cpus=1, gpus=8)) + "\n"


def _fail(host: str, check: str = "gpu-count", message: str = "4 GPUs visible") -> str:
    return (
        protocol.encode(protocol.PreflightCheckFailed(host=host, check=check, detail=message))
        + "\n"
        f"srun: error: {host}: task 1: Exited with exit code 70\n"
    )


def _preflight(
    nodes: list[str], failing: dict[str, str], silent: set[str] = frozenset()
) -> StepOutcome:  # type: ignore[assignment]
    log = "".join(
        _fail(n, failing[n]) if n in failing else ("" if n in silent else _ok(n)) for n in nodes
    )
    rc = 70 if failing or silent else 0
    return StepOutcome(name="preflight-chat", nodes=tuple(nodes), returncode=rc, log=log)


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=6, unique=True),
    data=st.data(),
)
def test_preflight_blames_a_node_exactly_when_it_alone_failed(
    nodes: list[str], data: st.DataObject
) -> None:
    failing_nodes = data.draw(st.lists(st.sampled_from(nodes), unique=True, max_size=len(nodes)))
    checks = ["gpu-count", "gpu-list", "port", "model-path"]
    failing = {n: data.draw(st.sampled_from(checks)) for n in failing_nodes}
    found = blame("preflight", [_preflight(nodes, failing)])
    if len(failing) == 1:
        (node,) = failing
        assert found.node == node and found.kind == "preflight"
        assert f"preflight check {failing[node]} failed" in found.reason
    else:
        assert found.node is None
        if failing:
            assert f"{len(failing)} nodes failed" in found.reason


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.lists(st.sampled_from(NODES), min_size=2, max_size=6, unique=True),
    data=st.data(),
)
def test_a_node_that_said_nothing_blames_none(nodes: list[str], data: st.DataObject) -> None:
    silent = data.draw(st.sampled_from(nodes))
    bad = data.draw(st.sampled_from([n for n in nodes if n != silent] or [silent]))
    failing = {} if bad == silent else {bad: "port"}
    found = blame("preflight", [_preflight(nodes, failing, {silent})])
    assert found.node is None and f"{silent} reported nothing" in found.reason


@pytest.mark.parametrize("check", ["identity", "ntasks", "hostname"])
def test_plan_level_checks_are_not_a_node(check: str) -> None:
    found = blame("preflight", [_preflight(["node1", "node2"], {"node1": check})])
    assert found.node is None and "the plan or srun" in found.reason


def test_one_node_failing_two_steps_is_still_one_node() -> None:
    # The client and a deployment share node1: both its preflights fail, on the same node.
    client = StepOutcome("preflight-client", ("node1",), 70, _fail("node1", "port"))
    chat = _preflight(["node1", "node2"], {"node1": "port"})
    passed = _preflight(["node3"], {})
    assert blame("preflight", [client, chat, passed]).node == "node1"


def test_an_unreachable_node_is_named_by_srun() -> None:
    log = _ok("node1") + (
        "srun: error: Task launch for StepId=7.2 failed on node node2: Communication "
        "connection failure\n"
    )
    found = blame("preflight", [StepOutcome("preflight-chat", ("node1", "node2"), 1, log)])
    assert found.node == "node2" and found.kind == "unreachable"
    assert "Communication connection failure" in found.reason


def _serve(
    nodes: list[str], crashed: dict[str, float], started: set[str] | None = None
) -> StepOutcome:
    lines = []
    for n in nodes:
        if started is None or n in started:
            lines.append(protocol.encode(protocol.LaneStarted(host=n, lane="chat-r0")))
    for n, uptime in crashed.items():
        lines.append(
            protocol.encode(
                protocol.LaneExited(host=n, lane="chat-r0", status=134, uptime_s=uptime)
            )
        )
    for n in nodes:
        if n not in crashed:
            lines.append(f"[node-worker {n}] stop requested: stopping lanes")
    return StepOutcome("serve-chat", tuple(nodes), 134, "\n".join(lines) + "\n")


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=6, unique=True),
    data=st.data(),
    phase=st.sampled_from(["launch", "readiness", "endpoints", "client"]),
)
def test_a_lane_crash_blames_its_node_only_when_alone_late_and_beside_healthy_nodes(
    nodes: list[str], data: st.DataObject, phase: str
) -> None:
    crashed_nodes = data.draw(st.lists(st.sampled_from(nodes), unique=True, max_size=len(nodes)))
    uptimes = st.floats(min_value=0.0, max_value=3 * LANE_CRASH_MIN_UPTIME_S)
    crashed = {n: data.draw(uptimes) for n in crashed_nodes}
    found = blame(phase, [_serve(nodes, crashed)])
    late = {n: u for n, u in crashed.items() if round(u, 1) >= LANE_CRASH_MIN_UPTIME_S}
    expected = (
        len(crashed) == 1 and len(late) == 1 and len(nodes) >= 2
    )  # one crash, after the start-up window, with another node's lanes running
    assert (found.node is not None) == expected, found
    if expected:
        assert found.node == next(iter(late)) and found.kind == "lane-crash"


def test_a_crash_beside_nodes_that_never_started_blames_none() -> None:
    found = blame("readiness", [_serve(["node1", "node2"], {"node1": 90.0}, started={"node1"})])
    assert found.node is None and "no other node" in found.reason


def test_slurm_losing_a_node_blames_it_at_any_age() -> None:
    step = _serve(["node1", "node2"], {})
    lost = StepOutcome(step.name, step.nodes, 1, step.log + "srun: error: Node failure on node2\n")
    found = blame("client", [lost])
    assert found.node == "node2" and found.kind == "unreachable"


def test_failures_that_are_no_node_s() -> None:
    # a client that failed while every serve step ran; a readiness timeout; salloc refused
    running = StepOutcome("serve-chat", ("node1", "node2"), None, "")
    assert blame("client", [running]).node is None
    assert blame("readiness", [running]).node is None
    assert blame("allocate", []).node is None
    spawn_failed = protocol.LaneSpawnFailed(host="node1", lane="chat-r0", detail="No such file")
    spawn = StepOutcome("serve-chat", ("node1", "node2"), 71, protocol.encode(spawn_failed) + "\n")
    assert "could not start" in blame("launch", [spawn]).reason


def test_retry_decision() -> None:
    node = blame("preflight", [_preflight(["node1", "node2"], {"node2": "gpu-count"})])
    assert node.node == "node2"
    go = retry_decision(node, owned_allocation=True, excluded=[], enabled=True)
    assert go.retry and go.exclude == ("node2",)
    again = retry_decision(node, owned_allocation=True, excluded=["node1"], enabled=True)
    assert not again.retry and "once is the limit" in again.why
    attached = retry_decision(node, owned_allocation=False, excluded=[], enabled=True)
    assert not attached.retry and "--exclude=node2" in attached.why
    off = retry_decision(node, owned_allocation=True, excluded=[], enabled=False)
    assert not off.retry and "off" in off.why
    none = blame("preflight", [_preflight(["node1", "node2"], {"node1": "port", "node2": "port"})])
    assert not retry_decision(none, owned_allocation=True, excluded=[], enabled=True).retry


def test_settings_from_the_environment() -> None:
    assert NodeFailureSettings.from_env({}) == NodeFailureSettings(retry=True, drain=False)
    both = NodeFailureSettings.from_env(
        {"SLURMGATE_NODE_RETRY": "off", "SLURMGATE_DRAIN_FAILED_NODES": "TRUE"}
    )
    assert both == NodeFailureSettings(retry=False, drain=True)
    with pytest.raises(NodeFailureSettingError, match="SLURMGATE_DRAIN_FAILED_NODES"):
        NodeFailureSettings.from_env({"SLURMGATE_DRAIN_FAILED_NODES": "maybe"})


def test_salloc_excludes_and_the_drain_reason_is_one_short_line() -> None:
    argv = slurm.salloc_argv(nodes=2, job_name="sg-x", exclude=["node1", "node3"])
    assert "--exclude=node1,node3" in argv
    assert "--exclude" not in " ".join(slurm.salloc_argv(nodes=2, job_name="sg-x"))
    reason = drain_reason("sg-x-1", "preflight check gpu-count failed:\n 4 GPUs " + "x" * 300)
    assert "\n" not in reason and len(reason) <= 120 and reason.startswith("slurmgate sg-x-1: ")


def test_record_keeps_its_layout_without_a_node_failure(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    RunRecord(run_id="sg-a").write(path)
    assert not {"node_failure", "excluded_nodes", "retry_of", "retried_as"} & set(
        json.loads(path.read_text())
    )
    failure = NodeFailure(node="node2", reason="r", kind="preflight", retried=True)
    RunRecord(run_id="sg-a", node_failure=failure, retried_as="sg-b").write(path)
    path.chmod(0o600)
    back = RunRecord.read(path)
    assert back.node_failure == failure and back.retried_as == "sg-b"


# -- the reaper's view of other users' runs ----------------------------------------------


def _job(job_id: str, name: str, comment: str, user: str = "runner") -> slurm.QueuedJob:
    return slurm.QueuedJob(job_id, name, user, "RUNNING", comment, user_id=1001)


def test_job_comment_round_trips_and_refuses_others() -> None:
    me = ProcessIdentity(pid=4242, started=99, host="login1")
    comment = job_comment("sg-a-1", me)
    assert parse_job_comment(comment) == ("sg-a-1", me, None)
    blank = ProcessIdentity(pid=7, started=None, host="login1")
    assert parse_job_comment(job_comment("sg-b", blank)) == ("sg-b", blank, None)
    beating = job_comment("sg-c", me, 1_796_000_000)
    assert beating.endswith(" beat=1796000000")
    assert parse_job_comment(beating) == ("sg-c", me, 1_796_000_000)
    for other in ["", "slurmgate", "slurmgate run=sg-a controller=login1/x/1", "ci wrapper"]:
        assert parse_job_comment(other) is None
    # a beat that is no time at all reads as none, not as an error
    for bad in ("-5", "soon", "9" * 40):
        assert parse_job_comment(f"{comment} beat={bad}") == ("sg-a-1", me, None)
    assert "--comment=" + comment in slurm.salloc_argv(nodes=1, job_name="j", comment=comment)


# A newline, the other C0 controls (the whitespace ones split() would swallow too), DEL, C1's
# NEL (a line break to str.splitlines), Unicode's line and paragraph separators, a bidirectional
# override and a no-break space: none is in a comment slurmgate writes.
UNPRINTABLE = ["\n", "\r", "\t", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x1b", "\x7f"]
UNPRINTABLE += ["\x85", "\x9b", "\u2028", "\u2029", "\u202e", "\xa0"]


@pytest.mark.parametrize("bad", UNPRINTABLE, ids=[f"U+{ord(c):04X}" for c in UNPRINTABLE])
def test_a_slurmgate_comment_holding_an_unprintable_character_is_refused(bad: str) -> None:
    dead = ProcessIdentity(pid=4_000_000, started=1, host="login1")
    comment = job_comment("sg-a-1", dead, 1_796_000_000)
    # the comment as the forgery test's forger wrote it, but starting with slurmgate's prefix:
    # its own run, then a newline and a whole forged line of a formatted listing
    forged_line = "\x1f".join(("4242", "sg-victim", "victim", "RUNNING", comment))
    cases = [
        comment + bad,  # at the end
        comment.replace(" controller=", f"{bad}controller="),  # in place of a separator
        comment.replace(" controller=", f" {bad}controller="),  # beside one
        comment.replace("=sg-a-1", f"=sg-a-1{bad}"),  # inside the run id
        f"{comment}{bad}{forged_line}",  # then another line
    ]
    for text in cases:
        assert text.startswith(JOB_COMMENT_PREFIX) and len(text) <= 400
        assert parse_job_comment(text) is None, repr(text)
    # the same comment with a space there is slurmgate's own
    assert parse_job_comment(comment + " ") == ("sg-a-1", dead, 1_796_000_000)


def test_a_dead_runs_job_whose_comment_holds_a_line_break_is_left_alone() -> None:
    dead = ProcessIdentity(pid=1, started=1, host="h1")
    jobs = [
        _job("16", "sg-nl", job_comment("sg-nl", dead) + "\n"),
        _job("17", "sg-ls", job_comment("sg-ls", dead) + "\u2028"),
        _job("18", "sg-ok", job_comment("sg-ok", dead)),
    ]
    found = foreign_stale_allocations(jobs, set(), host="h1", now=1e9, gone=lambda c: True)
    assert [a.job_id for a in found] == ["18"]


def test_foreign_stale_allocations_take_only_dead_controllers_of_this_host() -> None:
    dead, live = ProcessIdentity(pid=1, started=1, host="h1"), ProcessIdentity(pid=2, host="h1")
    jobs = [
        _job("10", "sg-dead", job_comment("sg-dead", dead)),
        _job("11", "sg-live", job_comment("sg-live", live)),
        _job("12", "sg-mine", job_comment("sg-mine", dead)),  # this user's record covers it
        _job("13", "sg-away", job_comment("sg-away", ProcessIdentity(pid=1, started=1, host="h2"))),
        _job("14", "someone-else", job_comment("sg-dead", dead)),  # a comment naming another job
        _job("15", "sg-plain", ""),
    ]
    found = foreign_stale_allocations(
        jobs, {"sg-mine"}, host="h1", now=1e9, gone=lambda c: c.pid == dead.pid
    )
    assert [(a.job_id, a.run_id, a.user) for a in found] == [("10", "sg-dead", "runner")]
    assert found[0].why == "controller pid 1 on h1 is gone"


def test_foreign_stale_allocations_of_other_hosts_go_by_their_heartbeat() -> None:
    away = ProcessIdentity(pid=1, started=1, host="login2")
    now = 1_796_000_000
    jobs = [
        _job("20", "sg-silent", job_comment("sg-silent", away, now - 601)),
        _job("21", "sg-beating", job_comment("sg-beating", away, now - 30)),
        _job("22", "sg-old", job_comment("sg-old", away)),  # no beat: nothing says it is gone
        _job("23", "sg-future", job_comment("sg-future", away, now + 3600)),  # a skewed clock
    ]
    # this host's process table knows nothing of login2's processes: it is never asked
    found = foreign_stale_allocations(jobs, set(), host="h1", now=now, gone=lambda c: 1 / 0)
    assert [a.job_id for a in found] == ["20"]
    assert found[0].why == "controller pid 1 on login2 last beat 601 s ago (over 600 s)"
    later = foreign_stale_allocations(
        jobs, set(), host="h1", now=now, stale_after_s=20, gone=lambda c: False
    )
    assert [a.job_id for a in later] == ["20", "21"]


def test_heartbeat_settings_name_the_variable() -> None:
    assert heartbeat.interval_from_env({}) == 60 and heartbeat.stale_after_from_env({}) == 600
    assert heartbeat.interval_from_env({"SLURMGATE_HEARTBEAT_S": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "1e9"):
        with pytest.raises(ValueError, match="SLURMGATE_REAP_STALE_S"):
            heartbeat.stale_after_from_env({"SLURMGATE_REAP_STALE_S": bad})


def test_an_attempt_asks_salloc_to_exclude_and_names_its_controller(tmp_path: Path) -> None:
    from slurmgate.runtime.run.allocation_run import AllocationRun
    from slurmgate.runtime.spec.allocation import AllocationSpec

    from .conftest import example_data

    spec = AllocationSpec.from_data(example_data())
    run = AllocationRun(spec, runs_root=tmp_path, exclude_nodes=("node2",), retry_of="sg-a")
    argv = slurm.salloc_argv(**run.salloc_request())
    assert "--exclude=node2" in argv
    (comment,) = [a.removeprefix("--comment=") for a in argv if a.startswith("--comment=")]
    parsed = parse_job_comment(comment)
    assert parsed is not None and parsed[:2] == (run.run_id, ProcessIdentity.current())
    assert parsed.beat is not None and abs(parsed.beat - time.time()) < 60
    record = json.loads(run.record_path.read_text())
    assert record["excluded_nodes"] == ["node2"] and record["retry_of"] == "sg-a"
