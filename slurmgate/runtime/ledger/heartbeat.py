"""The controller's heartbeat: its allocation's job comment carries the time it last beat.

A reaper on another host of the site cannot see the controller's process; it sees the
comment in `squeue`. A run that owns its allocation rewrites the comment's `beat=` every
`SLURMGATE_HEARTBEAT_S` seconds (60), so a reaper anywhere can tell a controller that stopped
beating (its host rebooted, its process was SIGKILLed) from one that still runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from slurmgate.runtime.ledger.comment import ProcessIdentity, job_comment
from slurmgate.settings.runtime import LedgerSettings
from slurmgate.slurm import commands as slurm

DEFAULT_INTERVAL_S = 60.0
DEFAULT_STALE_AFTER_S = 600.0
"""A beat older than this is a controller gone: ten intervals, room for clock skew and a
controller busy through a slow Slurm answer."""


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw[:40]!r} is not a number of seconds; set it to e.g. 60"
        ) from None
    if not 0 < value <= 86_400:
        raise ValueError(f"{name}={raw[:40]!r} must be in (0, 86400] seconds")
    return value


def interval_from_env(env: Mapping[str, str] | None = None) -> float:
    """`SLURMGATE_HEARTBEAT_S`: seconds between two beats (60)."""
    e = LedgerSettings.environ() if env is None else env
    return _seconds(e, "SLURMGATE_HEARTBEAT_S", DEFAULT_INTERVAL_S)


def stale_after_from_env(env: Mapping[str, str] | None = None) -> float:
    """`SLURMGATE_REAP_STALE_S`: a controller on another host whose beat is older is gone (600)."""
    e = LedgerSettings.environ() if env is None else env
    return _seconds(e, "SLURMGATE_REAP_STALE_S", DEFAULT_STALE_AFTER_S)


class Heartbeat:
    """Rewrites one allocation's comment with a fresh beat until stopped; a refused update
    is told once and retried at the next beat (a reaper's threshold spans many beats)."""

    def __init__(
        self,
        job_id: str,
        run_id: str,
        controller: ProcessIdentity,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        warn: Callable[[str], None] = lambda _m: None,
    ) -> None:
        self.job_id = job_id
        self.run_id = run_id
        self.controller = controller
        self.interval_s = interval_s
        self.beats = 0
        self._warn = warn
        self._warned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{job_id}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def beat(self) -> None:
        comment = job_comment(self.run_id, self.controller, int(time.time()))
        try:
            slurm.set_job_comment(self.job_id, comment, timeout=min(15.0, self.interval_s * 2))
        except slurm.SlurmError as exc:
            if not self._warned:
                self._warned = True
                self._warn(f"heartbeat of allocation {self.job_id} not written: {exc}")
            return
        self.beats += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        """Stop beating; returns once the thread has ended (a beat under way is bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=20.0)
