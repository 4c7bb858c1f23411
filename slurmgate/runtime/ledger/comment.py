"""The job comment of a run's allocation: its run, its controller and the controller's last beat."""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from slurmgate.runtime.procs import process_start_ticks


class ProcessIdentity(BaseModel):
    """One process for good: its host, its pid and when it started."""

    model_config = ConfigDict(frozen=True)

    pid: int
    started: int | None = None
    host: str = ""

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid=pid, started=process_start_ticks(pid), host=socket.gethostname())


JOB_COMMENT_PREFIX = "slurmgate run="


def job_comment(run_id: str, controller: ProcessIdentity, beat: int | None = None) -> str:
    """The comment of an allocation a run makes: its run, its controller and the controller's
    last heartbeat (epoch seconds), so a reaper of another user (the runner service's, say) or
    on another host finds it in `squeue` without the run's record."""
    started = str(controller.started) if controller.started is not None else "-"
    text = f"{JOB_COMMENT_PREFIX}{run_id} controller={controller.host}/{controller.pid}/{started}"
    return text if beat is None else f"{text} beat={beat}"


class JobComment(NamedTuple):
    """A parsed `job_comment`."""

    run_id: str
    controller: ProcessIdentity
    beat: int | None = None


def parse_job_comment(comment: str) -> JobComment | None:
    """The run, controller and heartbeat of a `job_comment`, or None for any other comment."""
    if not comment.startswith(JOB_COMMENT_PREFIX) or len(comment) > 400:
        return None
    if not comment.isprintable():
        # Written by the job's user, and slurmgate's own comments are plain printable ASCII: a
        # newline or any other control character (C0, DEL, C1 such as NEL), a line or paragraph
        # separator, or a format character (a bidirectional override) is a forgery.
        return None
    run_id, *words = comment[len(JOB_COMMENT_PREFIX) :].split()
    fields = dict(w.partition("=")[::2] for w in words)
    host, _, rest = fields.get("controller", "").partition("/")
    pid, _, started = rest.partition("/")
    if not run_id or not host or not pid.isdigit():
        return None
    beat = fields.get("beat", "")
    return JobComment(
        run_id,
        ProcessIdentity(
            pid=int(pid), started=int(started) if started.isdigit() else None, host=host
        ),
        int(beat) if beat.isdigit() and len(beat) <= 12 else None,
    )
