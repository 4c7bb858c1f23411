"""Site hooks: run a prolog or epilog under a guard that bounds its time and its process tree.

`python -m slurmgate.runtime.hooks NAME RUN_DIR` is the guard. It reads what to run from stdin
(the script, the hook's whole environment, its timeout and the secret values to mask), starts
the hook in a session of its own and, as a child subreaper, stays the parent of everything the
hook leaves behind. It stops that whole tree when the hook times out, when it is signalled,
and when its own parent (the controller) dies, even by SIGKILL: it polls getppid(). Should
the guard alone be SIGKILLed, the runner stops what is left of the hook's session. Each
output line is masked, written to the hook's log and echoed (bounded) to its stdout, which the
runner streams into the run's log. What happened is left in a small result file for the run.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import BaseModel

from slurmgate.runtime.procs import live_processes, process_start_ticks
from slurmgate.runtime.redact import Redactor

GRACE_S = 2.0  # SIGTERM to SIGKILL; under prefect-shell's 5 s before it kills the guard itself
PARENT_POLL_S = 0.1
WATCHDOG_SLACK_S = 30.0  # a runner kills a guard that outlives its hook's timeout by this much
ECHO_LINES = 400
ECHO_TAIL_LINES = 20
LINE_CHARS = 2000
TIMED_OUT = 124  # as timeout(1)
PARENT_GONE = 125
_PR_SET_CHILD_SUBREAPER = 36


class HookOutcome(BaseModel):
    """What one hook did: its exit status, or why it was stopped."""

    name: str
    returncode: int | None = None
    timed_out: bool = False
    stopped_by: str | None = None  # "timeout", "signal", "parent exited"
    seconds: float = 0.0
    timeout_s: float | None = None  # the hook's limit, when it ran under one
    leftovers: int = 0  # processes still running after the hook's shell exited: stopped
    log: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.stopped_by is None

    def describe(self) -> str:
        """One line: `succeeded in 1.2 s`, `exited 3 in …`, `timed out after 2 s …`."""
        if self.timed_out:
            # The limit, not the measured time: stopping the tree takes a moment more.
            limit = self.timeout_s if self.timeout_s is not None else self.seconds
            text = f"timed out after {limit:.1f} s; all its processes were stopped"
        elif self.stopped_by:
            text = f"stopped ({self.stopped_by}) after {self.seconds:.1f} s"
        elif self.returncode == 0:
            text = f"succeeded in {self.seconds:.1f} s"
        elif self.returncode is None:
            text = "did not report (its guard died)"
        else:
            text = f"exited {self.returncode} after {self.seconds:.1f} s"
        if self.leftovers:
            text += f"; {self.leftovers} process(es) it left running were stopped"
        return text


@dataclass
class HookInvocation:
    """One hook to run: the guard's argv and the stdin payload it reads (never argv: the env
    may hold credentials)."""

    name: str
    run_dir: Path
    commands: list[str]
    env: dict[str, str]
    timeout_s: float
    secrets: list[str] = field(default_factory=list, repr=False)
    parent_pid: int = field(default_factory=os.getpid)

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"hook-{self.name}.log"

    @property
    def result_path(self) -> Path:
        return self.run_dir / f"hook-{self.name}.json"

    @property
    def script_path(self) -> Path:
        return self.run_dir / f"hook-{self.name}.sh"

    @property
    def session_path(self) -> Path:
        """The hook's session, written by the guard as it starts the hook."""
        return self.run_dir / f"hook-{self.name}.session"

    def guard_argv(self) -> list[str]:
        # The controller's own interpreter: the guard runs on this host (the spec's `python`
        # is the compute nodes' one).
        return [sys.executable, "-m", "slurmgate.runtime.hooks", self.name, str(self.run_dir)]

    def payload_fd(self) -> int:
        """The payload in an unlinked 0600 file, as a read descriptor for the guard's stdin."""
        data = json.dumps(
            {
                "commands": self.commands,
                "env": self.env,
                "timeout_s": self.timeout_s,
                "secrets": self.secrets,
                "parent_pid": self.parent_pid,
            }
        ).encode()
        path = self.run_dir / f".hook-{self.name}.stdin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.unlink(path)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            os.close(fd)
            raise
        return fd

    def outcome(self) -> HookOutcome:
        """What the guard reported. A guard that died without a word (SIGKILLed alone) could
        not stop its hook: what is left of the hook's session is stopped here, and the outcome
        says so (returncode None, `leftovers`)."""
        try:
            return HookOutcome.model_validate_json(self.result_path.read_bytes())
        except (OSError, ValueError):
            pass
        leftovers = 0
        with contextlib.suppress(OSError, ValueError):
            started = HookSession.model_validate_json(self.session_path.read_bytes())
            leftovers = stop_session(started.session, started.started)
        return HookOutcome(name=self.name, log=str(self.log_path), leftovers=leftovers)

    def log_tail(self, chars: int = 1500) -> str:
        """The end of the hook's log (masked when written)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode(errors="replace")


class HookSession(BaseModel):
    """The session the guard started its hook in: the hook shell's pid, and when it started."""

    session: int
    started: int


def stop_session(session: int, started: int) -> int:
    """SIGKILL every process of `session` that started no earlier than its leader (a reused
    pid's session is someone else's), until none is left; how many were found at first."""
    found = 0
    for _ in range(20):
        members = [
            p.pid
            for p in live_processes()
            if p.session == session and (process_start_ticks(p.pid) or -1) >= started
        ]
        found = max(found, len(members))
        if not members:
            break
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return found


# Runs the guard of one invocation to its end (the Prefect layer streams its output into the
# flow run's log through prefect-shell; `run_plain` is the core's own).
HookRunner = Callable[[HookInvocation], None]


def stop_guard(pid: int) -> None:
    """SIGTERM the guard (it stops its hook within GRACE_S), then SIGKILL it if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S + 3.0
    while process_start_ticks(pid) is not None:  # None once exited (a zombie included)
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def start_watchdog(invocation: HookInvocation, pid: int) -> threading.Timer:
    """A timer that stops the guard `pid` if it outlives its hook's timeout by far (a runner
    cancels it once the guard is done)."""
    timer = threading.Timer(invocation.timeout_s + WATCHDOG_SLACK_S, stop_guard, args=(pid,))
    timer.daemon = True
    timer.start()
    return timer


def run_plain(invocation: HookInvocation, emit: Callable[[str], None]) -> None:
    """The core's runner: the guard as a child, each output line to `emit`."""
    fd = invocation.payload_fd()
    try:
        guard = subprocess.Popen(
            invocation.guard_argv(),
            stdin=fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        os.close(fd)
    assert guard.stdout is not None
    watchdog = start_watchdog(invocation, guard.pid)
    try:
        for raw in guard.stdout:
            emit(f"{invocation.name}| " + raw.decode(errors="replace").rstrip("\n"))
        guard.wait()
    finally:
        watchdog.cancel()
        if guard.poll() is None:  # interrupted (a signal to the controller): stop it now
            stop_guard(guard.pid)
            guard.wait()
        guard.stdout.close()


# -- the guard ----------------------------------------------------------------------------------


def _script(name: str, commands: list[str]) -> str:
    """One bash script: the commands in order; the first that fails ends it, and says so."""
    lines = []
    for i, command in enumerate(commands, 1):
        lines.append(command)
        lines.append(
            f'__sg_rc=$?; if [ "$__sg_rc" -ne 0 ]; then echo "slurmgate: {name} command {i} '
            f'of {len(commands)} exited $__sg_rc" >&2; exit "$__sg_rc"; fi'
        )
    return "\n".join(lines) + "\n"


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of `root`, from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for process in live_processes():
        children[process.ppid].append(process.pid)
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class _Echo:
    """Mask each line, write it to the log, echo the first ECHO_LINES and then the last few."""

    def __init__(self, name: str, log: Any, redact: Redactor) -> None:
        self.name = name
        self.log = log
        self.redact = redact
        self.echoed = 0
        self.skipped = 0
        self.held: collections.deque[str] = collections.deque(maxlen=ECHO_TAIL_LINES)

    def pump(self, stream: Any) -> None:
        for raw in stream:
            text = raw.decode(errors="replace").rstrip("\n").rstrip("\r").rsplit("\r", 1)[-1]
            self.line(self.redact(text[:LINE_CHARS]))

    def line(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()
        if self.echoed < ECHO_LINES:
            self.echoed += 1
            _say(text)
            return
        if len(self.held) == self.held.maxlen:
            self.skipped += 1
        self.held.append(text)

    def finish(self) -> None:
        if self.held:
            if self.skipped:
                _say(f"... {self.skipped} line(s) left out (all in {self.log.name})")
            while self.held:
                _say(self.held.popleft())


def _say(text: str) -> None:
    """A line to the runner; once its pipe is gone (a dead controller), to nowhere."""
    try:
        print(text, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _left_behind(settle_s: float = 0.25) -> list[int]:
    """The processes the hook left running: looked for again for a moment, since one still
    forking (or being handed to this subreaper) as the shell exits shows up late."""
    deadline = time.monotonic() + settle_s
    while True:
        left = descendants(os.getpid())
        if left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _stop_tree(hook: subprocess.Popen[bytes]) -> int:
    """SIGTERM the hook's group (a grace for the shell), then SIGKILL the group and every
    descendant until none is left; how many processes were found after the grace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(hook.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and hook.poll() is None:
        time.sleep(0.05)
    found = 0
    for _ in range(20):
        left = descendants(os.getpid())
        found = max(found, len(left))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(hook.pid, signal.SIGKILL)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _reap_all(0.2)
    return found


def _reap_all(timeout: float) -> None:
    """Wait for every child (the subreaper inherits the hook's orphans) until none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)


def guard(name: str, run_dir: Path, payload: dict[str, Any]) -> HookOutcome:
    """Run one hook to its end or its stop; the outcome is also written for the run."""
    parent = int(payload["parent_pid"])
    timeout_s = float(payload["timeout_s"])
    invocation = HookInvocation(name, run_dir, list(payload["commands"]), {}, timeout_s)
    outcome = HookOutcome(name=name, log=str(invocation.log_path), timeout_s=timeout_s)
    signalled: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signalled.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with os.fdopen(os.open(invocation.script_path, flags, 0o600), "w") as fh:
        fh.write(_script(name, invocation.commands))
    log = os.fdopen(os.open(invocation.log_path, flags, 0o600), "w")
    echo = _Echo(name, log, Redactor(payload.get("secrets", [])))
    t0 = time.monotonic()
    if os.getppid() != parent:  # the controller died before the hook could start
        outcome.stopped_by = "parent exited"
    else:
        hook = subprocess.Popen(
            ["bash", str(invocation.script_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(payload["env"]),
        )
        # For the runner, should this guard be SIGKILLed alone: it then stops the session.
        session = HookSession(session=hook.pid, started=process_start_ticks(hook.pid) or 0)
        with os.fdopen(os.open(invocation.session_path, flags, 0o600), "w") as fh:
            fh.write(session.model_dump_json())
        assert hook.stdout is not None
        reader = threading.Thread(target=echo.pump, args=(hook.stdout,), daemon=True)
        reader.start()
        deadline = t0 + timeout_s
        while hook.poll() is None:
            if os.getppid() != parent:
                outcome.stopped_by = "parent exited"
            elif signalled:
                outcome.stopped_by = f"signal {signal.Signals(signalled[0]).name}"
            elif time.monotonic() >= deadline:
                outcome.stopped_by, outcome.timed_out = "timeout", True
            if outcome.stopped_by:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                hook.wait(timeout=PARENT_POLL_S)
        outcome.seconds = round(time.monotonic() - t0, 3)
        # Stopped or done, nothing the hook started outlives it.
        if outcome.stopped_by:
            _stop_tree(hook)
        elif left := _left_behind():
            # counted as the shell left them: one still on its way into a session of its own
            # (setsid) may die of the group's SIGTERM before _stop_tree sees it
            outcome.leftovers = max(len(left), _stop_tree(hook))
        hook.wait()
        outcome.returncode = hook.returncode
        _reap_all(2.0)
        reader.join(timeout=2.0)
    echo.finish()
    if not outcome.ok:
        _say(f"slurmgate: {name} {outcome.describe()}")
    log.write(f"slurmgate: {name} {outcome.describe()}\n")
    log.close()
    invocation.result_path.write_text(outcome.model_dump_json())
    return outcome


def main(argv: list[str] | None = None) -> int:
    """`python -m slurmgate.runtime.hooks NAME RUN_DIR`, the payload on stdin."""
    name, run_dir = argv or sys.argv[1:3]
    payload = json.loads(sys.stdin.buffer.read())
    outcome = guard(name, Path(run_dir), payload)
    if outcome.timed_out:
        return TIMED_OUT
    if outcome.stopped_by == "parent exited":
        return PARENT_GONE
    if outcome.stopped_by:  # "signal SIGTERM"
        return 128 + int(signal.Signals[outcome.stopped_by.split()[-1]])
    return outcome.returncode if outcome.returncode is not None else 1


if __name__ == "__main__":
    sys.exit(main())
