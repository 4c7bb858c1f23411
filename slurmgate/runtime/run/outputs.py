"""Collect a run's logs and results from every node into its directory, redacted and bounded.

Cleanup calls `collect_all` after the steps stopped and before the allocation is released: one
short srun per node (`steps/outputs.py`'s collector, each under a time limit, so a dead node
costs its limit and no more), plus the controller's own step logs and the client's results.
Everything lands under `<run>/outputs/` with the run's secrets masked (`redact.py`'s redactor
with the run's own secret values) and each file cut to its head and tail past the bound.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from pydantic import ValidationError

from slurmgate.errors import ExternalError, InputError
from slurmgate.runtime.ledger.records import NodeOutputs
from slurmgate.runtime.run.state import RunContext
from slurmgate.runtime.steps import outputs as node_outputs
from slurmgate.settings.runtime import OutputsSettings
from slurmgate.slurm import commands as slurm

STEPS = "steps"
CLIENT = "client"
# The collector's own start (an srun, a Python import) on top of what a node may take.
KILL_GRACE_S = 2.0
# Attempts per node without Prefect (the Prefect layer's task retries instead).
CORE_ATTEMPTS = 2
# Removing a node's copy that was not collected: a short step, bounded tighter than collection.
REMOVE_TIMEOUT_S = 10.0


class CollectFailed(ExternalError):
    """One node's outputs could not be collected (its step failed or ran out of time)."""


@dataclass(frozen=True)
class CollectOptions:
    """How a run collects: on or off, the bound of each file, one node's time limit."""

    enabled: bool = True
    max_file_bytes: int = node_outputs.DEFAULT_MAX_FILE_BYTES
    node_timeout_s: float = 30.0

    @classmethod
    def from_env(cls) -> CollectOptions:
        """The operator's settings (OutputsSettings); a bad value is one line naming it."""
        try:
            s = OutputsSettings()
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ".".join(str(p) for p in err.get("loc", ())) or "SLURMGATE_OUTPUTS_*"
            raise InputError(
                f"{name}: {err.get('msg', 'invalid')}; fix the variable or unset it "
                "(docs/settings.md)"
            ) from None
        return cls(s.collect, s.max_file_bytes, s.node_timeout_s)


# -- storing, redacted and bounded -----------------------------------------------------------


def _safe_relative(name: str) -> PurePosixPath | None:
    """`name` as a path inside the destination, or None when it would leave it."""
    path = PurePosixPath(name)
    if path.is_absolute() or not path.parts or any(p in {"", ".", ".."} for p in path.parts):
        return None
    return path


def store(dest: Path, name: str, data: bytes, redact: Callable[[str], str]) -> Path | None:
    """Write `data`, its credentials masked, as `dest/name` (0600, parents 0700, no link
    followed, nothing outside `dest`). Bytes that are not UTF-8 pass through unchanged."""
    rel = _safe_relative(name)
    if rel is None:
        return None
    text = data.decode("utf-8", errors="surrogateescape")
    clean = redact(text).encode("utf-8", errors="surrogateescape")
    target = dest.joinpath(*rel.parts)
    if dest.resolve() not in target.resolve().parents:
        return None
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(clean)
    return target


def unpack(archive: Path, dest: Path, redact: Callable[[str], str], bound: int) -> NodeOutputs:
    """A collector's archive into `dest`: regular files only, each masked; its manifest read."""
    out = NodeOutputs(node=dest.name, status="collected", dir=str(dest))
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    # the cut mark's line on top of the bound, and no more: the archive came over the network
    limit = bound + 512
    with tarfile.open(archive, mode="r:gz") as tar:
        for member in tar:
            if not member.isfile() or member.size > limit:
                out.skipped.append(f"{member.name} (not a regular file within the bound)")
                continue
            fh = tar.extractfile(member)
            data = fh.read(limit) if fh is not None else b""
            if member.name == node_outputs.MANIFEST:
                manifest = json.loads(data)
                out.cut = list(manifest.get("cut", []))
                out.skipped += list(manifest.get("skipped", []))
                continue
            if store(dest, member.name, data, redact) is None:
                out.skipped.append(f"{member.name} (a path outside the node's folder)")
            else:
                out.files += 1
    return out


def store_local(
    src: Path, dest: Path, redact: Callable[[str], str], bound: int, *, only: str = "*"
) -> NodeOutputs:
    """Files under `src` on this host (those matching `only` at its top), bounded and masked."""
    out = NodeOutputs(node=dest.name, status="collected", dir=str(dest))
    if not src.is_dir():
        return out
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if not rel.parts[0:1] or not Path(rel.parts[0]).match(only):
            continue
        if path.is_symlink() or not path.is_file():
            continue
        try:
            data, size = node_outputs.bounded(str(path), bound)
        except OSError as exc:
            out.skipped.append(f"{rel} ({exc.strerror})")
            continue
        if store(dest, rel.as_posix(), data, redact) is not None:
            out.files += 1
            if size > bound:
                out.cut.append(rel.as_posix())
    return out


# -- one node --------------------------------------------------------------------------------


def _node_argv(ctx: RunContext, host: str, action: list[str], timeout_s: float) -> list[str]:
    """`steps/outputs.py`'s `action` as an srun on `host`: one task, no GPU, Slurm's own time
    limit too."""
    command = [ctx.python, "-m", "slurmgate.runtime.steps.outputs", *action]
    return slurm.srun_argv(
        command,
        job_id=ctx.job_id or "",
        nodelist=[host],
        step_name=ctx.step_name(f"{action[0]}-{host}"),
        gres="none",
        kill_on_bad_exit=False,
        extra=[f"--time={max(1, math.ceil(timeout_s / 60))}"],
    )


def collect_argv(ctx: RunContext, host: str, options: CollectOptions) -> list[str]:
    """The collector's srun on `host`."""
    action = ["collect", ctx.run_id, str(options.max_file_bytes)]
    return _node_argv(ctx, host, action, options.node_timeout_s)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """TERM the srun's group (srun cancels its step), then KILL after a short grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _node_step(
    ctx: RunContext,
    argv: list[str],
    timeout_s: float,
    stdout: IO[bytes] | int,
    stderr: IO[bytes] | int,
) -> int | None:
    """One srun on a node, its group stopped past `timeout_s` (and a grace): its exit code, or
    None when it ran out of time. Raises OSError when srun cannot start."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=ctx.base_env(),  # it carries the operator's SLURMGATE_NODE_OUTPUTS_ROOT
        start_new_session=True,
        close_fds=True,
    )
    try:
        return proc.wait(timeout=timeout_s + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return None


def collect_node(ctx: RunContext, host: str, options: CollectOptions | None = None) -> NodeOutputs:
    """`host`'s logs and results into `<run>/outputs/<host>`; raises CollectFailed."""
    options = options or CollectOptions.from_env()
    ctx.outputs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    # The archive goes to a file, never memory: its size is files times the bound.
    prefix = f".{host}-"
    with (
        tempfile.NamedTemporaryFile(dir=ctx.outputs_dir, prefix=prefix, suffix=".tgz") as fh,
        tempfile.TemporaryFile() as errors,
    ):
        argv = collect_argv(ctx, host, options)
        try:
            rc = _node_step(ctx, argv, options.node_timeout_s, fh, errors)
        except OSError as exc:
            raise CollectFailed(f"{host}: could not start srun: {exc.strerror}") from None
        if rc is None:
            raise CollectFailed(
                f"{host}: no archive within {options.node_timeout_s:g} s "
                "(SLURMGATE_OUTPUTS_NODE_TIMEOUT_S)"
            )
        errors.seek(0)
        said = " ".join(errors.read()[-600:].decode(errors="replace").split())
        if rc != 0:
            raise CollectFailed(ctx.redact(f"{host}: the collector step exited {rc}: {said}"))
        dest = ctx.outputs_dir / host
        try:
            return unpack(Path(fh.name), dest, ctx.redact, options.max_file_bytes)
        except (tarfile.TarError, OSError, ValueError, EOFError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise CollectFailed(f"{host}: unreadable archive: {reason}") from None


def failed(host: str, error: str, attempts: int) -> NodeOutputs:
    return NodeOutputs(node=host, status="failed", attempts=attempts, error=error)


def collect_with_retries(
    ctx: RunContext, host: str, options: CollectOptions, attempts: int = CORE_ATTEMPTS
) -> NodeOutputs:
    """One node without Prefect: `attempts` tries; the last failure becomes its record."""
    error = ""
    for attempt in range(1, attempts + 1):
        try:
            got = collect_node(ctx, host, options)
            got.attempts = attempt
            return got
        except CollectFailed as exc:
            error = str(exc)
            ctx.log(f"outputs: attempt {attempt} of {attempts} on {host} failed: {error}")
            time.sleep(0.5)
    return failed(host, error, attempts)


def collect_nodes(ctx: RunContext, hosts: list[str], options: CollectOptions) -> list[NodeOutputs]:
    """Every host at once: the slowest node bounds the wait, not their sum."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(hosts)))) as pool:
        return list(pool.map(lambda h: collect_with_retries(ctx, h, options), hosts))


# -- what collection leaves on the nodes -----------------------------------------------------


def remove_node_copy(ctx: RunContext, host: str, timeout_s: float) -> bool:
    """Remove the run's outputs from `host` (lane logs hold what lanes printed, unmasked):
    one srun under `timeout_s`; whether it did."""
    argv = _node_argv(ctx, host, ["remove", ctx.run_id], timeout_s)
    try:
        return _node_step(ctx, argv, timeout_s, subprocess.DEVNULL, subprocess.DEVNULL) == 0
    except OSError:
        return False


def remove_node_copies(ctx: RunContext, hosts: list[str], timeout_s: float) -> dict[str, bool]:
    """`remove_node_copy` on every host at once; host -> whether its copy is gone."""
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(hosts)))) as pool:
        done = pool.map(lambda h: remove_node_copy(ctx, h, timeout_s), hosts)
        return dict(zip(hosts, done, strict=True))


def node_copy_path(ctx: RunContext, host: str) -> str:
    """Where `host` keeps the run's outputs (as its node worker computes it)."""
    return node_outputs.node_dir(ctx.run_id, host, OutputsSettings.text("node_root") or None)


# -- the whole run ---------------------------------------------------------------------------


def collect_all(ctx: RunContext, options: CollectOptions | None = None) -> list[str]:
    """The controller's step logs, the client's results and every node's outputs into
    `<run>/outputs/`; recorded in the run's record. Never raises: cleanup goes on."""
    try:
        options = options or CollectOptions.from_env()
    except InputError as exc:
        ctx.log(f"outputs not collected: {exc}")
        return [f"outputs not collected: {exc}"]
    hosts = list(dict.fromkeys(ctx.layout.hosts)) if ctx.layout and ctx.job_id else []
    # before the launch only preflights ran on the nodes: no lane wrote anything there, and a
    # run that failed its preflight (a Python missing on the nodes) could not collect anyway
    if not ctx.launched_at:
        hosts = []
    # a node's copy that is not collected is removed all the same, within this much time
    remove_s = min(REMOVE_TIMEOUT_S, options.node_timeout_s)
    if not options.enabled:
        removed = remove_node_copies(ctx, hosts, remove_s)
        line = "outputs not collected (SLURMGATE_OUTPUTS_COLLECT is off)"
        left = [h for h, gone in removed.items() if not gone]
        if left:
            line += "; left on " + ", ".join(f"{h} in {node_copy_path(ctx, h)}" for h in left)
        ctx.log(line)
        return [line]
    t0 = time.monotonic()
    ctx.outputs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    bound = options.max_file_bytes
    got = [
        store_local(ctx.run_dir, ctx.outputs_dir / STEPS, ctx.redact, bound, only="[0-9]*.log"),
        store_local(
            ctx.client_results_dir, ctx.outputs_dir / CLIENT / "results", ctx.redact, bound
        ),
    ]
    got[1].node = CLIENT
    # the unredacted originals of the client's results go; the masked copy stays
    shutil.rmtree(ctx.client_results_dir, ignore_errors=True)
    if hosts:
        collect = ctx.collect_nodes or (lambda h: collect_nodes(ctx, h, options))
        try:
            got += collect(hosts)
        except Exception as exc:  # a collector's bug must not stop the release after it
            reason = ctx.redact(f"{type(exc).__name__}: {exc}")
            got += [failed(h, reason, 0) for h in hosts if h not in {g.node for g in got}]
        missed = [o for o in got if o.node in hosts and o.status != "collected"]
        removed = remove_node_copies(ctx, [o.node for o in missed], remove_s)
        for o in missed:
            o.left_on_node = None if removed[o.node] else node_copy_path(ctx, o.node)
            o.node_copy_removed = removed[o.node]
    ctx.outputs = got
    ctx.timings.mark("collect", t0)
    ctx.save()
    lines = [_describe(o) for o in got]
    for line in lines:
        ctx.log(f"outputs: {line}")
    ctx.log(f"outputs of run {ctx.run_id} are in {ctx.outputs_dir}")
    return lines


def _describe(o: NodeOutputs) -> str:
    if o.status != "collected":
        said = f"{o.node}: not collected after {o.attempts} attempt(s): {o.error}"
        if o.left_on_node:
            return f"{said}; its copy is left on the node in {o.left_on_node}"
        return f"{said}; its copy was removed from the node" if o.node_copy_removed else said
    cut = f", {len(o.cut)} cut to head and tail" if o.cut else ""
    left = f", {len(o.skipped)} left out" if o.skipped else ""
    return f"{o.node}: {o.files} file(s) collected{cut}{left}"


__all__ = [
    "CollectFailed",
    "CollectOptions",
    "collect_all",
    "collect_node",
]
