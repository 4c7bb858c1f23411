"""The step supervisor with real processes (no Slurm): order, idempotence, groups, signals."""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from slurmgate.runtime.run.supervisor import StepFailed, Supervisor
from slurmgate.runtime.steps import protocol

from .conftest import assert_no_orphans

# Logs "<name> term" on SIGTERM (after a short pause), with a grandchild in the same group.
TRAPPING = (
    "import os,signal,subprocess,sys,time\n"
    "name, log = sys.argv[1], sys.argv[2]\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "def term(*a):\n"
    "    time.sleep(0.2); open(log,'a').write(name+' term\\n'); child.kill(); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "time.sleep(300)\n"
)


def _env(token: str) -> dict[str, str]:
    return dict(os.environ, SLURMGATE_RUN_ID=token)


def _argv(name: str, log: Path) -> list[str]:
    return [sys.executable, "-c", TRAPPING, name, str(log)]


def test_cleanup_is_reverse_order_idempotent_and_final(tmp_path: Path) -> None:
    token = f"sup-{os.getpid()}-order"
    log = tmp_path / "order.log"
    sup = Supervisor(tmp_path / "run", grace_s=5)
    for name in ("a", "b", "c"):
        sup.start(name, _argv(name, log), env=_env(token))
    time.sleep(0.5)
    first = sup.cleanup()
    assert first.complete
    assert log.read_text().split("\n")[:3] == ["c term", "b term", "a term"]
    second = sup.cleanup()
    assert second is first and log.read_text().count("term") == 3  # no second signal
    with pytest.raises(StepFailed, match="cleanup has begun"):
        sup.start("late", ["true"])
    assert_no_orphans(token)


def test_logs_are_private(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "run")
    step = sup.start("echo", ["sh", "-c", "echo hello"])
    assert sup.wait(step, timeout=10) == 0
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(step.log_path).st_mode) == 0o600
    assert "hello" in step.log_tail()
    sup.cleanup()


def test_wait_fails_as_soon_as_a_required_peer_exits(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "run")
    sup.start("server", ["sh", "-c", "sleep 0.5; exit 3"], required=True)
    client = sup.start("client", ["sleep", "60"], required=False)
    t0 = time.monotonic()
    with pytest.raises(StepFailed, match="required step server exited with status 3"):
        sup.wait(client)
    assert time.monotonic() - t0 < 3
    assert sup.cleanup().complete


def test_start_failure_is_a_step_failure(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "run")
    with pytest.raises(StepFailed, match="could not start"):
        sup.start("ghost", ["/nonexistent/srun"])
    assert sup.cleanup().complete


def test_stubborn_group_is_killed_after_the_grace(tmp_path: Path) -> None:
    token = f"sup-{os.getpid()}-stubborn"
    sup = Supervisor(tmp_path / "run", grace_s=0.5)
    sup.start(
        "stubborn",
        ["sh", "-c", "trap '' TERM; sleep 300 & wait"],
        env=_env(token),
    )
    time.sleep(0.3)
    report = sup.cleanup()
    assert report.complete and any("KILL" in a for a in report.actions)
    assert_no_orphans(token)


def test_signal_during_spawn_is_delivered_after_registration(tmp_path: Path) -> None:
    token = f"sup-{os.getpid()}-spawn"
    sup = Supervisor(tmp_path / "run")
    seen: list[int] = []

    class Stop(BaseException):
        pass

    def handler(signum: int, frame: object) -> None:
        seen.append(len(sup.steps))
        raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    try:
        # A sitecustomize-free way to land a signal inside start(): send it from the argv hook.
        original = sup._changed

        def changed() -> None:
            if not seen and sup.steps:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while start() holds signals
            original()

        sup._changed = changed  # type: ignore[method-assign]
        with pytest.raises(Stop):
            sup.start("child", ["sleep", "60"], env=_env(token))
        assert seen == [1]  # delivered only once the child was registered
        assert sup.cleanup().complete
    finally:
        signal.signal(signal.SIGTERM, old)
    assert_no_orphans(token)


def test_signal_during_cleanup_waits_for_it_to_finish(tmp_path: Path) -> None:
    token = f"sup-{os.getpid()}-midclean"
    log = tmp_path / "order.log"
    sup = Supervisor(tmp_path / "run", grace_s=5)
    sup.start("a", _argv("a", log), env=_env(token))
    sup.start("b", _argv("b", log), env=_env(token))
    time.sleep(0.5)

    class Stop(BaseException):
        pass

    states: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        states.append(sup.cleaned)
        sup.cleanup()  # re-entry from the handler is a no-op
        raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    try:
        timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        with pytest.raises(Stop):
            sup.cleanup()  # the first TERM pauses 0.2 s, so the signal lands mid-cleanup
        timer.join()
    finally:
        signal.signal(signal.SIGTERM, old)
    assert states == [True]
    assert log.read_text().splitlines() == ["b term", "a term"]
    assert_no_orphans(token)


def test_a_failed_steps_cause_names_the_lane_and_node_from_its_log() -> None:
    exited = protocol.LaneExited("node3", "d-prefill-00000-rank-00000", status=1, uptime_s=9.0)
    log = "noise\n" + protocol.encode(exited) + "\nend"
    cause = protocol.lane_exit_cause(log)
    assert cause == ": lane d-prefill-00000-rank-00000 on node node3 exited with status 1"
    assert protocol.lane_exit_cause("srun: error: node3: task 0: Exited") == ""
