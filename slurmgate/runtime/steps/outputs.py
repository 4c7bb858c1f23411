"""A node's run outputs: where lanes leave logs and results, and the collector that streams them.

The standard library only: the node worker imports it on every node, and the collector runs
as its own short srun step (`python -m slurmgate.runtime.steps.outputs collect ...`) inside
the allocation after the lanes stopped. It writes one gzip'd tar to stdout, every file in it
bounded (its head and tail kept), then removes the node's copy (`remove` alone, when the run
does not collect or its collection failed). Redaction is the controller's:
the run's secret values never leave the controller host.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import threading
from collections.abc import Callable
from typing import IO, Any, BinaryIO

from slurmgate.settings import handed
from slurmgate.slurm.jobenv import slurm_variable

LOGS = "logs"
RESULTS = "results"
MANIFEST = ".slurmgate-manifest.json"
DEFAULT_MAX_FILE_BYTES = 4 * 1024 * 1024
# A lane that writes thousands of files into its results dir must not turn the collection into
# a transfer of everything: past this many files the rest are named in the manifest only.
MAX_FILES = 2000
CUT_MARK = "\n[slurmgate: {cut} bytes cut from the middle of this {size}-byte file; the first "
CUT_MARK += "{head} and last {tail} bytes are kept (bound {bound} bytes)]\n"


def node_name() -> str:
    """This node as Slurm names it (as the node worker does): SLURMD_NODENAME, else the host."""
    return slurm_variable("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def outputs_root() -> str:
    """Node-local root of every run's outputs: SLURMGATE_NODE_OUTPUTS_ROOT, else the temp dir."""
    root = handed.handed(handed.NODE_OUTPUTS_ROOT)
    return root or os.path.join(tempfile.gettempdir(), "slurmgate-outputs")


def node_dir(run_id: str, host: str, root: str | None = None) -> str:
    """This run's outputs on `host`: one directory per node, even where nodes share /tmp."""
    for what, value in (("run id", run_id), ("host", host)):
        if not value or "/" in value or value in {".", ".."}:
            raise ValueError(f"{what} {value!r} cannot name a directory")
    return os.path.join(root or outputs_root(), run_id, host)


def prepare(run_id: str, host: str) -> tuple[str, str]:
    """Make (0700) and return this node's logs and results directories for the run."""
    base = node_dir(run_id, host)
    for path in (base, os.path.join(base, LOGS), os.path.join(base, RESULTS)):
        os.makedirs(path, mode=0o700, exist_ok=True)
    return os.path.join(base, LOGS), os.path.join(base, RESULTS)


def open_log(logs_dir: str, name: str) -> BinaryIO:
    """A 0600 log file `name`.log, appended to (a lane restarted in the same run keeps both)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "lane"
    fd = os.open(
        os.path.join(logs_dir, f"{safe}.log"),
        os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
        0o600,
    )
    return os.fdopen(fd, "ab")


def tee(source: IO[bytes], write_line: Callable[[bytes], None], log: BinaryIO) -> threading.Thread:
    """Copy a lane's output, line by line, to `write_line` (the step's own output, where the
    controller reads it) and to its node-local `log`, until the lane closes it.

    Whole lines: srun interleaves the node worker's protocol lines with the lane's output, and
    a line split across two writes would come apart there."""

    def pump() -> None:
        try:
            for line in iter(lambda: source.readline(1 << 16), b""):
                # the step's output may have closed: the node-local log still gets the line
                with contextlib.suppress(OSError, ValueError):
                    write_line(line)
                log.write(line)
                log.flush()
        except (OSError, ValueError):
            pass
        finally:
            log.close()

    thread = threading.Thread(target=pump, daemon=True, name="lane-output")
    thread.start()
    return thread


def bounded(path: str, bound: int) -> tuple[bytes, int]:
    """The file's bytes when at most `bound`, else its head and tail with a line saying what
    was cut; and its size. Reads at most `bound` bytes, however large the file."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size <= bound:
            return fh.read(bound), size
        head = bound // 2
        tail = bound - head
        first = fh.read(head)
        fh.seek(size - tail)
        last = fh.read(tail)
    mark = CUT_MARK.format(cut=size - head - tail, size=size, head=head, tail=tail, bound=bound)
    return first + mark.encode() + last, size


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


def write_archive(
    src: str, out: BinaryIO, bound: int, max_files: int = MAX_FILES
) -> dict[str, Any]:
    """Stream every regular file under `src` (links are skipped, never followed) into a gzip'd
    tar on `out`, each bounded; last, a manifest of sizes, what was cut and what was left out."""
    manifest: dict[str, Any] = {"files": {}, "cut": [], "skipped": [], "bound": bound}
    with tarfile.open(fileobj=out, mode="w|gz") as tar:
        for top, dirs, files in os.walk(src, followlinks=False):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(top, name)
                rel = os.path.relpath(path, src)
                if os.path.islink(path) or not os.path.isfile(path):
                    manifest["skipped"].append(f"{rel} (not a regular file)")
                    continue
                if len(manifest["files"]) >= max_files:
                    manifest["skipped"].append(f"{rel} (past {max_files} files)")
                    continue
                try:
                    data, size = bounded(path, bound)
                except OSError as exc:
                    manifest["skipped"].append(f"{rel} ({exc.strerror})")
                    continue
                _add(tar, rel, data)
                manifest["files"][rel] = size
                if size > bound:
                    manifest["cut"].append(rel)
        _add(tar, MANIFEST, json.dumps(manifest).encode())
    return manifest


def collect(run_id: str, bound: int, out: BinaryIO, *, keep: bool = False) -> dict[str, Any]:
    """This node's outputs of the run as an archive on `out`; the node's copy is then removed
    (it holds what the lanes printed, unredacted) unless `keep`."""
    src = node_dir(run_id, node_name())
    if not os.path.isdir(src):
        os.makedirs(src, mode=0o700, exist_ok=True)  # nothing was written: an empty archive
    manifest = write_archive(src, out, bound)
    out.flush()
    if not keep:
        remove(run_id)
    return manifest


def remove(run_id: str) -> bool:
    """Remove this node's outputs of the run (a collection that failed, or none asked for);
    whether there was a copy. The run's own directory goes once its last node's copy went."""
    src = node_dir(run_id, node_name())
    there = os.path.lexists(src)
    shutil.rmtree(src, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(src))
    if os.path.lexists(src):
        raise OSError(f"{src} could not be removed")
    return there


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m slurmgate.runtime.steps.outputs collect RUN_ID MAX_FILE_BYTES [--keep]"
        " | remove RUN_ID"
    )
    if len(args) == 2 and args[0] == "remove":
        try:
            remove(args[1])
        except (OSError, ValueError) as exc:
            print(f"outputs: remove failed on {node_name()}: {exc}", file=sys.stderr)
            return 1
        return 0
    if len(args) < 3 or args[0] != "collect" or not args[2].isdigit() or int(args[2]) < 1024:
        print(usage + " (MAX_FILE_BYTES at least 1024)", file=sys.stderr)
        return 64
    try:
        collect(args[1], int(args[2]), sys.stdout.buffer, keep="--keep" in args[3:])
    except (OSError, ValueError) as exc:
        print(f"outputs: collect failed on {node_name()}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
