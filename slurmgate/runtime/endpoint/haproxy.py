"""The compiled data plane: HAProxy forwards the common request, the endpoint decides the rest.

Why: measured with wrk (``benchmarks/bench_endpoint.py``), the Python data plane's own work per
small JSON request costs about as much again as a whole request through nginx, so its CPU per
request stayed 2-3x nginx's however it was trimmed. HAProxy (Debian's, one thread) forwards at
nginx's cost, and unlike nginx it takes a lane in or out of rotation at run time over its admin
socket, so the endpoint stays the control plane: the same samplers, health probes and queue
policy decide, every ``SYNC_S``, which lanes take work (``set server ... state ready|drain``).

``--data-plane haproxy`` splits a request's way by its head:

- **HAProxy** listens on the endpoint's address (the socket is bound here and handed over as a
  file descriptor, so port 0 and a given socket work as before) and forwards straight to the
  least-busy lane that takes work: any method and path but the control paths, no body or a
  Content-Length body within ``--max-body-bytes``, and, with a token, exactly
  ``Authorization: Bearer TOKEN`` (compared in constant time; the token goes to HAProxy over its
  admin socket, never through a file, argv or the environment). Each lane has its share of
  ``--pool-size`` connections (``maxconn``); a request past it waits in HAProxy's queue and
  counts as waiting in the lane's queue, as it does here.
- **The Python data plane** (``app.py``), on a Unix socket beside HAProxy's admin socket in a
  private directory, answers everything else by its own rules: ``/health`` and ``/metrics``, a
  missing or wrong token (401), a chunked body, a body over the limit (413), and every request
  while no lane takes work: 429 with Retry-After when every lane is over its queue limit,
  panic mode when none is in rotation.

On the fast path HAProxy's rules replace the endpoint's (its configuration is
``render_config``), as nginx's defaults would: only a failed connection is retried on another
lane (at most ``--max-attempts`` tries); a lane's answer, 429 and 5xx included, is passed on,
since HAProxy retries answers only by keeping a copy of every request (measured: a quarter more
CPU per small request, the cost this plane exists to save); there is one upstream timeout, the
larger of ``--first-byte-timeout`` and ``--read-timeout``; and the circuit breaker sees only the
slow path's answers, so a failing lane leaves rotation by its health probes and its queue
gauge. HAProxy errors of its own are JSON like the endpoint's. HAProxy dies with the endpoint
(``PR_SET_PDEATHSIG``), and the endpoint stops, exit 1, if HAProxy exits first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from slurmgate.errors import ExternalError
from slurmgate.runtime.endpoint.answers import json_error
from slurmgate.runtime.endpoint.backpressure import Lane, QueuePolicy
from slurmgate.runtime.endpoint.config import EndpointConfig
from slurmgate.runtime.endpoint.dataplane import (
    CLIENT_HEAD_TIMEOUT_S,
    CLIENT_KEEPALIVE_S,
    MAX_HEADER_BYTES,
)
from slurmgate.settings.handed import inherited

# How often the lanes' counts are read from HAProxy and their states pushed to it: the queue
# samplers' default interval, so a sample's verdict reaches HAProxy within one more interval.
# Each sync costs the endpoint about 0.1 ms of CPU (a Unix connection, one short CSV).
SYNC_S = 0.1
# HAProxy's buffer: the largest request head it takes, as the Python data plane's.
BUFFER_BYTES = MAX_HEADER_BYTES
START_TIMEOUT_S = 10.0
ADMIN_TIMEOUT_S = 2.0
MAX_ADMIN_ANSWER = 1 << 20  # ``show stat`` is ~300 bytes a lane; more is not HAProxy talking
BACKEND = "lanes"
DIRECTORY_PREFIX = "slurmgate-endpoint-"  # then the endpoint's pid: a dead one's is swept
ANSWER_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")  # HAProxy counts answers by class only
SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, the terminating NUL included
SLOW = "endpoint"
PR_SET_PDEATHSIG = 1


class DataPlaneError(ExternalError):
    """HAProxy could not be started or stopped answering; the message names the fix."""


def haproxy_binary() -> str | None:
    """HAProxy's path (Debian puts it in /usr/sbin, which a user's PATH may lack), or None."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/sbin/haproxy") if Path(p).exists()), None
    )


def _seconds(value: float) -> str:
    return f"{max(1, round(value * 1000))}ms"


def _error_file(status: int, kind: str, message: str) -> str:
    """HAProxy's own answer of a status, in the endpoint's JSON error shape."""
    body = json_error(status, kind, message).decode()  # no single quote: HAProxy's quoting
    return f"  http-error status {status} content-type application/json string '{body}'\n"


def render_config(
    config: EndpointConfig, listen_fd: int, directory: Path, max_connections: int
) -> str:
    """HAProxy's configuration for the endpoint: the fast path to the lanes, the rest to the
    Python data plane on ``directory/endpoint.sock``; its admin socket is
    ``directory/admin.sock``. No secret is in it."""
    per_lane = max(1, config.pool_size // len(config.backends))
    upstream = max(config.first_byte_timeout, config.read_timeout)
    fast = [
        "!{ path /health /metrics }",
        "!{ req.hdr(transfer-encoding) -m found }",
        f"!{{ req.hdr_val(content-length) gt {config.max_body_bytes} }}",
        "{ nbsrv(lanes) gt 0 }",
    ]
    if config.token is not None:
        # set over the admin socket once HAProxy runs (``HAProxyPlane.start``)
        fast.insert(0, "{ req.hdr(authorization),secure_memcmp(proc.expected) }")
    servers = "".join(
        f"  server lane{i} {url.removeprefix('http://')} maxconn {per_lane}"
        f" pool-purge-delay {_seconds(config.keepalive_timeout)}\n"
        for i, url in enumerate(config.backends)
    )
    return (
        "global\n"
        "  nbthread 1\n"
        f"  maxconn {2 * max_connections + config.pool_size + 64}\n"
        f"  tune.bufsize {BUFFER_BYTES}\n"
        f"  stats socket {directory / 'admin.sock'} mode 600 level admin\n"
        "defaults\n"
        "  mode http\n"
        f"  timeout connect {_seconds(config.connect_timeout)}\n"
        f"  timeout client {_seconds(config.body_timeout)}\n"
        f"  timeout http-request {_seconds(CLIENT_HEAD_TIMEOUT_S)}\n"
        f"  timeout http-keep-alive {_seconds(CLIENT_KEEPALIVE_S)}\n"
        f"  timeout server {_seconds(upstream)}\n"
        f"  timeout queue {_seconds(config.first_byte_timeout)}\n"
        + _error_file(400, "invalid_request_error", "bad request")
        + _error_file(408, "request_timeout", "request not complete in time")
        + _error_file(502, "bad_gateway", "no lane answered")
        + _error_file(503, "service_unavailable", "no lane took the request in time")
        + _error_file(504, "gateway_timeout", "the lane did not answer in time")
        + "frontend endpoint\n"
        f"  bind fd@{listen_fd}\n"
        f"  maxconn {max_connections}\n"
        f"  use_backend {BACKEND} if {' '.join(fast)}\n"
        f"  default_backend {SLOW}\n"
        f"backend {BACKEND}\n"
        "  balance leastconn\n"
        "  http-reuse always\n"
        f"  retries {config.max_attempts - 1}\n"
        # connection failures only, each on another lane: ``retry-on`` for answers would keep
        # a copy of every request (measured: a quarter more CPU per small request)
        "  option redispatch 1\n"
        "  http-request del-header authorization\n"
        f"{servers}"
        f"backend {SLOW}\n"
        f"  server python unix@{directory / 'endpoint.sock'}\n"
    )


def takes_work(lane: Lane, policy: QueuePolicy, now: float) -> bool:
    """Whether HAProxy may send the lane new requests: in rotation, breaker closed, under its
    queue limit. A lane that may not is drained, and only the Python path decides for it."""
    return lane.in_rotation and not lane.breaker.tripped and policy.admits(lane, now)


def read_counts(stat: str, lanes: Sequence[Lane]) -> None:
    """Copy each lane's HAProxy counts from ``show stat`` (CSV) into the lane: in flight
    (queued included), queued, newly routed requests, and its answers by status class."""
    lines = stat.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise OSError(f"HAProxy's show stat has no header: {stat[:80]!r}")
    columns = lines[0][2:].split(",")
    try:
        at = [columns.index(name) for name in ("pxname", "svname", "scur", "qcur", "stot")]
    except ValueError as exc:
        raise OSError(f"HAProxy's show stat lacks a column: {exc}") from None
    classes = {c: columns.index(f"hrsp_{c}") for c in ANSWER_CLASSES if f"hrsp_{c}" in columns}
    need = max(at) + 1
    by_name = {f"lane{lane.index}": lane for lane in lanes}
    for line in lines[1:]:
        row = line.split(",")
        if len(row) < need or row[at[0]] != BACKEND or (lane := by_name.get(row[at[1]])) is None:
            continue
        try:
            current, queued, total = int(row[at[2]]), int(row[at[3]]), int(row[at[4]])
        except ValueError:
            continue
        lane.plane_active, lane.plane_queued = current + queued, queued
        lane.requests += max(0, total - lane.plane_routed)
        lane.plane_routed = total
        for name, column in classes.items():
            if column < len(row) and row[column].isdigit():
                lane.plane_answers[name] = int(row[column])


def socket_root() -> Path:
    """Where the plane's directory goes: the temporary directory, unless a socket path in it
    would pass Linux's 107-byte limit (a deep $TMPDIR), then /tmp."""
    root = Path(tempfile.gettempdir())
    deepest = root / f"{DIRECTORY_PREFIX}{2**22}-abcdefgh" / "endpoint.sock"
    return root if len(str(deepest)) <= SOCKET_PATH_MAX else Path("/tmp")


def sweep_dead_directories(root: Path | None = None) -> list[Path]:
    """Remove the directories of endpoints that died without a stop (killed outright, so
    their ``stop`` never ran): this user's, whose process is gone. Returns those removed."""
    removed = []
    for directory in (root or socket_root()).glob(f"{DIRECTORY_PREFIX}*-*"):
        pid = directory.name.removeprefix(DIRECTORY_PREFIX).split("-", 1)[0]
        try:
            mine = directory.lstat().st_uid == os.getuid() and directory.is_dir()
        except OSError:
            continue
        if not (mine and pid.isdigit()) or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def _die_with_parent() -> None:
    """In HAProxy's child, before exec: SIGKILL when the endpoint dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class HAProxyPlane:
    """HAProxy in front of the endpoint: started, kept in step with the lanes, stopped."""

    def __init__(self, config: EndpointConfig, lanes: Sequence[Lane], policy: QueuePolicy):
        self.config = config
        self.lanes = list(lanes)
        self.policy = policy
        sweep_dead_directories()
        prefix = f"{DIRECTORY_PREFIX}{os.getpid()}-"
        self.directory = Path(tempfile.mkdtemp(prefix=prefix, dir=socket_root()))
        self.slow_socket = self.directory / "endpoint.sock"
        self.admin_socket = self.directory / "admin.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.died = asyncio.Event()  # HAProxy exited on its own: the endpoint must stop
        self.sync_failures = 0
        self.ready: dict[int, bool] = {}  # each lane's state as last set in HAProxy
        self._task: asyncio.Task[None] | None = None

    async def start(self, listener: socket.socket, max_connections: int) -> None:
        """Start HAProxy on ``listener`` (the Python data plane must already listen on
        ``slow_socket``), hand it the token, and keep the lanes in step."""
        binary = haproxy_binary()
        if binary is None:
            raise DataPlaneError(
                "--data-plane haproxy: HAProxy is not installed (Debian: apt-get install "
                "haproxy); or leave --data-plane at python"
            )
        conf = self.directory / "haproxy.cfg"
        conf.write_text(
            render_config(self.config, listener.fileno(), self.directory, max_connections)
        )
        self.proc = subprocess.Popen(
            [binary, "-db", "-q", "-f", str(conf)],
            pass_fds=(listener.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            stderr=sys.stderr,
            # PATH alone: the endpoint's environment holds its token
            env={"PATH": inherited().get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise DataPlaneError(
                    f"--data-plane haproxy: HAProxy exited with {self.proc.returncode} at "
                    "start (its message is above); or leave --data-plane at python"
                )
            with contextlib.suppress(OSError, TimeoutError):
                await self.command("show info")
                break
            if time.monotonic() > deadline:
                raise DataPlaneError(
                    f"--data-plane haproxy: HAProxy's admin socket did not answer within "
                    f"{START_TIMEOUT_S:g} s"
                )
            await asyncio.sleep(0.02)
        if self.config.token is not None:
            expected = "Bearer " + self.config.token.get_secret_value()
            # the space is escaped for the command line; the token's characters need none
            # (the config allows only a b64token)
            answer = await self.command(
                "experimental-mode on; set var proc.expected expr str("
                + expected.replace(" ", "\\ ")
                + ")"
            )
            if answer.strip():  # silent when it took; its complaint may quote the token
                raise DataPlaneError(
                    "--data-plane haproxy: HAProxy refused the bearer token over its admin "
                    "socket; leave --data-plane at python"
                )
        await self.sync()
        self._task = asyncio.create_task(self._keep_in_step(), name="haproxy-sync")

    async def command(self, line: str) -> str:
        """One command on HAProxy's admin socket (it answers and closes), bounded in time and
        size."""
        async with asyncio.timeout(ADMIN_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(str(self.admin_socket))
            try:
                writer.write(line.encode() + b"\n")
                answer = await reader.read(MAX_ADMIN_ANSWER + 1)
                while chunk := await reader.read(MAX_ADMIN_ANSWER + 1 - len(answer)):
                    answer += chunk
                    if len(answer) > MAX_ADMIN_ANSWER:
                        break
            finally:
                writer.close()
        if len(answer) > MAX_ADMIN_ANSWER:
            raise OSError(f"HAProxy's answer to {line.split()[0]!r} is over {MAX_ADMIN_ANSWER}")
        return answer.decode(errors="replace")

    async def sync(self) -> None:
        """Read the lanes' counts from HAProxy, then set each lane whose verdict changed."""
        read_counts(await self.command(f"show stat {BACKEND} 4 -1"), self.lanes)
        now = time.monotonic()
        changes = []
        for lane in self.lanes:
            ready = takes_work(lane, self.policy, now)
            if self.ready.get(lane.index) != ready:
                state = "ready" if ready else "drain"
                line = f"set server {BACKEND}/lane{lane.index} state {state}"
                changes.append((lane.index, ready, line))
        if changes:
            answer = await self.command("; ".join(line for _, _, line in changes))
            if answer.strip():  # HAProxy says nothing when every command took
                raise OSError(f"HAProxy refused a lane's state: {answer.strip()[:200]}")
            for index, ready, _ in changes:
                self.ready[index] = ready

    async def _keep_in_step(self) -> None:
        assert self.proc is not None
        while True:
            await asyncio.sleep(SYNC_S)
            if self.proc.poll() is not None:
                print(
                    f"endpoint {self.config.name}: HAProxy exited with {self.proc.returncode}; "
                    "the endpoint stops",
                    file=sys.stderr,
                    flush=True,
                )
                self.died.set()
                return
            try:
                await self.sync()
            except (OSError, TimeoutError) as exc:
                # HAProxy keeps the last states it was given; the next tick tries again
                self.sync_failures += 1
                if self.sync_failures in (1, 100):
                    print(
                        f"endpoint {self.config.name}: HAProxy's admin socket: {exc}",
                        file=sys.stderr,
                        flush=True,
                    )

    async def stop(self, grace: float) -> None:
        """Stop listening and let requests in flight finish for ``grace`` seconds, then end
        HAProxy and remove its directory."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # soft stop: finish what is in flight
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.wait)
        shutil.rmtree(self.directory, ignore_errors=True)
