"""Launch and supervise srun steps from the main thread, and stop them exactly once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from slurmgate.errors import ExternalError
from slurmgate.runtime.procs import group_alive
from slurmgate.runtime.steps.protocol import lane_exit_cause
from slurmgate.slurm import commands as slurm

TERMINATION_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)


class StepFailed(ExternalError):
    """A required step exited, or a step could not be started."""

    def __init__(self, message: str, step: Step | None = None) -> None:
        self.step = step
        super().__init__(message)


class CleanupFailed(ExternalError):
    """Something of the run was still alive after cleanup."""


@dataclass
class Step:
    """One launched srun (or local) process, its process group and its Slurm step id."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    step_name: str | None
    required: bool
    started_at: float
    step_id: str | None = None
    stopped: bool = False
    redact: Callable[[str], str] = field(default=lambda text: text, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session=True makes it the group leader

    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, n: int = 2000) -> str:
        """The end of the step's log, with credentials masked: tails are copied into errors,
        records and Prefect logs (a server may print its --api-key)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        # Read a little more than asked, so a secret cut at the start is still recognized.
        return self.redact(data[-(n + 256) :].decode(errors="replace"))[-n:]


@dataclass
class CleanupReport:
    """What cleanup did, per step, in order."""

    actions: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.survivors


class _SignalDeferral:
    """Hold SIGTERM/SIGINT during a critical window and re-deliver the first one after it."""

    def __init__(self) -> None:
        self._depth = 0
        self._saved: dict[int, Any] = {}
        self._pending: list[int] = []

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum not in self._pending:
            self._pending.append(signum)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers can only be swapped in the main thread; signals land there anyway
            return
        if self._depth == 0:
            self._pending = []
            for sig in TERMINATION_SIGNALS:
                self._saved[sig] = signal.signal(sig, self._record)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for sig, handler in self._saved.items():
                    signal.signal(sig, handler)
                self._saved.clear()
                pending, self._pending = self._pending, []
                for sig in pending[:1]:
                    signal.raise_signal(sig)


DEFER = _SignalDeferral()


def private_dir(path: Path) -> Path:
    """Create (or accept) a 0700 directory that is not a symlink."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_symlink():
        raise StepFailed(f"run directory {path} is a symlink — use a real directory")
    os.chmod(path, 0o700)
    return path


class Supervisor:
    """Owns the run's processes: start, watch, and one idempotent cleanup in reverse order."""

    def __init__(
        self,
        run_dir: Path,
        *,
        job_id: str | None = None,
        grace_s: float = 10.0,
        poll_s: float = 0.1,
        on_change: Callable[[Supervisor], None] | None = None,
        redact: Callable[[str], str] | None = None,
    ) -> None:
        self.run_dir = private_dir(Path(run_dir))
        self.redact = redact or (lambda text: text)
        self.job_id = job_id
        self.slurmctld_silent = False  # a scancel timed out during cleanup
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.steps: list[Step] = []
        self._on_change = on_change
        self._lock = threading.RLock()
        self._state = "open"  # open -> cleaning -> closed
        self._cleaner: int | None = None
        self.report: CleanupReport | None = None

    # -- launching -------------------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        required: bool = True,
        step_name: str | None = None,
        stdin_data: bytes | None = None,
        pipes: bool = False,
    ) -> Step:
        """Spawn in a new session with output to a 0600 log; signals wait until it is registered.

        `stdin_data` (what must stay out of argv) reaches the process through an unlinked 0600
        file, so a large payload never blocks on a pipe. With `pipes` the caller talks to the
        process over unbuffered stdin and stdout pipes instead, and only stderr goes to the log.
        """
        with DEFER.hold():
            if self._state != "open":
                raise StepFailed(f"cannot start {name}: cleanup has begun")
            log_path = self.run_dir / f"{len(self.steps):02d}-{name}.log"
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            stdin_fd = self._stdin_file(name, stdin_data) if stdin_data is not None else None
            try:
                stdin: int = subprocess.DEVNULL if stdin_fd is None else stdin_fd
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.PIPE if pipes else stdin,
                    stdout=subprocess.PIPE if pipes else fd,
                    stderr=fd if pipes else subprocess.STDOUT,
                    bufsize=0,
                    start_new_session=True,
                    close_fds=True,
                    env=dict(env) if env is not None else None,
                )
            except OSError as exc:
                raise StepFailed(f"could not start {name} ({argv[0]}): {exc.strerror}") from None
            finally:
                os.close(fd)
                if stdin_fd is not None:
                    os.close(stdin_fd)
            step = Step(
                name=name,
                argv=list(argv),
                popen=popen,
                log_path=log_path,
                step_name=step_name,
                required=required,
                started_at=time.monotonic(),
                redact=self.redact,
            )
            self.steps.append(step)
            self._changed()
        return step

    def _stdin_file(self, name: str, data: bytes) -> int:
        path = self.run_dir / f".{len(self.steps):02d}-{name}.stdin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.unlink(path)  # only the open descriptor holds it from here on
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            os.close(fd)
            raise
        return fd

    def resolve_step_ids(self, timeout: float = 3.0) -> None:
        """Find the Slurm step id of every running srun by its unique step name."""
        if not self.job_id:
            return
        deadline = time.monotonic() + timeout
        while True:
            missing = [
                s for s in self.steps if s.step_name and not s.step_id and s.returncode() is None
            ]
            if not missing:
                return
            try:
                by_name = {i.name: i.step_id for i in slurm.list_steps(self.job_id)}
            except slurm.SlurmError:
                by_name = {}
            found = False
            for s in missing:
                if s.step_name in by_name:
                    s.step_id = by_name[s.step_name]
                    found = True
            if found:
                self._changed()
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    # -- watching --------------------------------------------------------------------------

    def check_required(self, exclude: Step | None = None) -> None:
        """Raise StepFailed if any required long-running step has exited."""
        for s in self.steps:
            if s is exclude or not s.required or s.stopped:
                continue
            rc = s.returncode()
            if rc is not None:
                tail, cause = s.log_tail(), lane_exit_cause(s.log_tail(16000))
                raise StepFailed(
                    f"required step {s.name} exited with status {rc}{cause}; log tail:\n{tail}",
                    s,
                )

    def wait(
        self,
        step: Step,
        timeout: float | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> int:
        """Wait for `step` to exit; fail at once if a required peer exits first. `on_poll`
        runs every poll (e.g. to copy the step's new output), and once more after it exits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = step.returncode()
            if on_poll is not None:
                on_poll()
            if rc is not None:
                return rc
            self.check_required(exclude=step)
            if deadline is not None and time.monotonic() >= deadline:
                raise StepFailed(f"step {step.name} did not finish within {timeout:g} s", step)
            # Wake as soon as the awaited step exits; peers are checked every poll.
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.popen.wait(timeout=self.poll_s)

    # -- cleanup ---------------------------------------------------------------------------

    @property
    def cleaned(self) -> bool:
        return self._state == "closed"

    def cleanup(self) -> CleanupReport:
        """Stop every step in reverse launch order: Slurm TERM, grace, KILL + killpg. Once."""
        me = threading.get_ident()
        if self._state == "cleaning" and self._cleaner == me:
            return self.report or CleanupReport()  # re-entered from a handler inside cleanup
        with self._lock:
            if self._state == "closed" and self.report is not None:
                return self.report
            self._state = "cleaning"
            self._cleaner = me
            report = CleanupReport()
            self.report = report
            t0 = time.monotonic()
            with DEFER.hold():
                try:
                    self._stop_all(report)
                finally:
                    report.seconds = time.monotonic() - t0
                    self._state = "closed"
                    self._cleaner = None
                    self._changed()
            return report

    def _stop_all(self, report: CleanupReport) -> None:
        running = [s for s in self.steps if s.returncode() is None]
        if running and self.job_id and any(s.step_name and not s.step_id for s in running):
            self.resolve_step_ids(timeout=0.5)
        for step in reversed(self.steps):
            self._stop(step, report)
            step.stopped = True
        for step in self.steps:
            if group_alive(step.pgid) or step.returncode() is None:
                report.survivors.append(f"{step.name} (pgid {step.pgid})")

    def _stop(self, step: Step, report: CleanupReport) -> None:
        t0 = time.monotonic()
        if step.returncode() is None:
            if step.step_id and not self.slurmctld_silent:
                try:
                    slurm.scancel(step.step_id, signal="TERM", timeout=10)
                    report.actions.append(f"scancel -s TERM {step.step_id} ({step.name})")
                except slurm.SlurmError as exc:
                    report.actions.append(f"scancel -s TERM {step.step_id} failed: {exc}")
                    if exc.timed_out:
                        # A controller that timed out once will time out for every step: go
                        # straight to the local srun (it forwards signals without slurmctld).
                        self.slurmctld_silent = True
                    _killpg(step.pgid, signal.SIGTERM)
            else:
                _killpg(step.pgid, signal.SIGTERM)
                report.actions.append(f"SIGTERM to group {step.pgid} ({step.name})")
            if _wait_exit(step, self.grace_s):
                report.actions.append(
                    f"{step.name} exited {step.returncode()} after {time.monotonic() - t0:.2f} s"
                )
            else:
                if step.step_id and not self.slurmctld_silent:
                    with contextlib.suppress(slurm.SlurmError):
                        slurm.scancel(step.step_id, timeout=10)
                _killpg(step.pgid, signal.SIGKILL)
                report.actions.append(f"KILL {step.name} after {self.grace_s:g} s grace")
                _wait_exit(step, 5.0)
        # Anything the srun client left in its session goes too.
        if group_alive(step.pgid):
            _killpg(step.pgid, signal.SIGKILL)
            _wait_group_gone(step.pgid, 2.0)

    # -- records ---------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "name": s.name,
                "pid": s.pid,
                "pgid": s.pgid,
                "step_name": s.step_name,
                "step_id": s.step_id,
                "log": str(s.log_path),
                "returncode": s.returncode(),
            }
            for s in self.steps
        ]

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_exit(step: Step, timeout: float) -> bool:
    try:
        step.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
