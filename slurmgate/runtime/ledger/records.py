"""Run records: what one allocation run owns in Slurm, as a typed file written atomically."""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from slurmgate.paths import check_trusted, runs_roots
from slurmgate.runtime.hooks import HookOutcome
from slurmgate.runtime.ledger.comment import ProcessIdentity
from slurmgate.runtime.procs import cmdline_contains, process_start_ticks

RECORD_NAME = "record.json"
# A record is a few kilobytes; anything far larger was not written by a controller.
MAX_RECORD_BYTES = 1 << 20


class RunStatus(StrEnum):
    """Where a run stands; only `running` and `cleanup-failed` may still hold Slurm resources."""

    RUNNING = "running"
    CLEAN = "clean"  # cleanup verified; the run's own outcome is settled next
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CLEANUP_FAILED = "cleanup-failed"
    REAPED = "reaped"

    @property
    def finished(self) -> bool:
        """The run owns nothing in Slurm any more."""
        return self in _FINISHED


_FINISHED = frozenset({RunStatus.CLEAN, RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.REAPED})


class StepRecord(BaseModel):
    """One launched srun of the run: its process group and Slurm step, for a later reaper."""

    model_config = ConfigDict(extra="allow", coerce_numbers_to_str=True)

    name: str = ""
    pid: int | None = None
    pgid: int | None = None
    step_name: str | None = None
    step_id: str | None = None
    log: str | None = None
    returncode: int | None = None


class NodeFailure(BaseModel):
    """The one node a failed run blamed: why, what was decided, and the drain if one was asked."""

    node: str
    reason: str
    kind: str  # "preflight", "unreachable" or "lane-crash"
    retried: bool = False
    decision: str = ""
    drain: str | None = None  # what `scontrol update ... state=drain` did, when it was asked


class NodeOutputs(BaseModel):
    """What a run collected from one node (or from its own steps and client on the controller):
    where it is, how many files, which were cut to the bound or left out, or why it failed."""

    node: str
    status: str  # "collected" or "failed"
    dir: str | None = None
    files: int = 0
    cut: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    attempts: int = 1
    error: str | None = None
    # a node's copy that was not collected: removed, or where it is left (a dead node)
    node_copy_removed: bool = False
    left_on_node: str | None = None


class RunRecord(BaseModel):
    """The record.json of one run. Unknown keys are kept, so older and newer files round-trip.

    The controller rewrites it at every phase; a reaper adds the `reap_*` fields. `path` is
    where it was read from (never stored in the file).
    """

    model_config = ConfigDict(extra="allow", coerce_numbers_to_str=True)

    run_id: str
    name: str = ""
    job_id: str | None = None
    owned_allocation: bool = False
    hosts: list[str] = Field(default_factory=list)
    phase: str = "new"
    status: RunStatus = RunStatus.RUNNING
    error: str | None = None
    controller_pid: int | None = None
    controller_started: int | None = None
    controller_host: str | None = None  # absent in the oldest records: taken as this host
    cleanup_complete: bool | None = None
    steps: list[StepRecord] = Field(default_factory=list)
    hooks: dict[str, HookOutcome] = Field(default_factory=dict)  # the site's prolog and epilog
    # node failures: the node this run blamed, the nodes it was told to avoid, its other attempt
    node_failure: NodeFailure | None = None
    excluded_nodes: list[str] = Field(default_factory=list)
    retry_of: str | None = None
    retried_as: str | None = None
    # requests each stand-in worker (Dynamo's mocker) said it served, by lane, after the client
    lane_served: dict[str, float] = Field(default_factory=dict)
    # the lanes' logs and results collected from every node before cleanup, redacted and bounded
    # (runtime/run/outputs.py), and where a copy was uploaded, or why it was not
    outputs_dir: str | None = None
    outputs: list[NodeOutputs] = Field(default_factory=list)
    outputs_upload: str | None = None
    # written by a reaper
    status_before_reap: RunStatus | None = None
    reaped_at: float | None = None
    reaped_by: ProcessIdentity | None = None
    reap_actions: list[str] | None = None
    reap_failures: int | None = None
    reap_retry_at: float | None = None
    reap_error: str | None = None

    path: Path | None = Field(default=None, exclude=True)
    # the uid that owned the file at `path` when it was read: never a key of the file
    _owner_uid: int | None = PrivateAttr(default=None)

    @property
    def owner_uid(self) -> int:
        """The uid owning the record file it was read from; this process's own for a record
        never read from a file (it is about to write it)."""
        return os.geteuid() if self._owner_uid is None else self._owner_uid

    def controller_alive(self) -> bool:
        """The run's controller process still exists (same pid and start time), so it owns
        cleanup. Records written before the start time was kept fall back to a python process
        holding the pid (not this one, which cannot be a dead controller)."""
        if self.controller_pid is None:
            return False
        if self.controller_started is not None:
            return process_start_ticks(self.controller_pid) == self.controller_started
        return self.controller_pid != os.getpid() and cmdline_contains(
            self.controller_pid, "python"
        )

    def on_this_host(self) -> bool:
        return self.controller_host in (None, socket.gethostname())

    def to_json(self) -> str:
        data = self.model_dump(mode="json")
        # A run never reaped, or that no node failed, keeps the layout it always had.
        for key in _REAPER_FIELDS + _NODE_FAILURE_FIELDS:
            if data.get(key) is None:
                data.pop(key, None)
        for key in ("excluded_nodes", "lane_served", "outputs", "outputs_dir", "outputs_upload"):
            if not data.get(key):
                data.pop(key, None)
        return json.dumps(data, indent=1)

    def write(self, path: Path | None = None) -> None:
        """Replace the file atomically (0600: it names processes and Slurm jobs).

        The new content goes to a fresh file created exclusively without following links (a
        name planted in advance fails the write instead of redirecting it), then is renamed
        over the record, which replaces a planted link rather than writing through it.
        """
        target = path or self.path
        if target is None:
            raise ValueError(f"run {self.run_id}: no record file to write to")
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(self.to_json())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        """One record file of this user; raises OSError or ValueError (pydantic's, and
        UntrustedRecord) when unusable."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            check_trusted(path, st)
            data = fh.read(MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"{path} is larger than {MAX_RECORD_BYTES} bytes")
        record = cls.model_validate(json.loads(data))
        record.path = path
        record._owner_uid = st.st_uid
        return record


_REAPER_FIELDS = (
    "status_before_reap",
    "reaped_at",
    "reaped_by",
    "reap_actions",
    "reap_failures",
    "reap_retry_at",
    "reap_error",
)


_NODE_FAILURE_FIELDS = ("node_failure", "excluded_nodes", "retry_of", "retried_as")


def controller_identity() -> dict[str, Any]:
    """The record fields that name the current process as a run's controller."""
    me = ProcessIdentity.current()
    return {"controller_pid": me.pid, "controller_started": me.started, "controller_host": me.host}


def _to_stderr(message: str) -> None:
    print(f"[slurmgate] {message}", file=sys.stderr, flush=True)


def load_records(
    runs_root: Path | None = None, *, warn: Callable[[str], Any] = _to_stderr
) -> list[RunRecord]:
    """Every usable run record under the runs root (by default the runs home, and the legacy
    one while it holds runs: `paths.runs_roots`). Each one skipped (unreadable, not valid, or
    not trusted) is one `warn` line: its run's leftovers are not reaped until it is fixed."""
    roots = [runs_root] if runs_root else runs_roots()
    out = []
    for path in [p for root in roots for p in sorted(root.glob(f"*/{RECORD_NAME}"))]:
        try:
            out.append(RunRecord.read(path))
        except (OSError, ValueError) as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            warn(f"run record skipped, its leftovers will not be reaped: {path}: {reason}")
    return out
