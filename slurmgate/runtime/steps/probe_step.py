"""Readiness probes from the client host: one long-lived step that probes URLs on request.

Login nodes often cannot reach compute-node ports, so a controller that runs off the
allocation probes through this step instead of from its own host. The client host is where the
logical endpoints and the client connect from, so its view is the one that matters (the seed
probes from there too). The controller writes one JSON request line to the step's stdin per
poll and reads one JSON answer line from its stdout. The step exits at the end of its input,
after an idle spell, or at its Slurm time limit, and every line either way is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import httpx

from slurmgate.errors import ExternalError
from slurmgate.runtime.steps.node_worker import node_name
from slurmgate.runtime.steps.readiness import ProbeItem, fetch_text, probe_chain, probe_item

MAX_LINE_BYTES = 2 * 1024 * 1024  # a request or an answer line; longer is a protocol failure
MAX_TEXT_CHARS = 512 * 1024  # a fetched document (an endpoint's /metrics) is cut to this
MAX_URLS = 512  # per request: every lane head twice over is far below it
IDLE_EXIT_S = 120.0  # no request for this long: the controller is gone, stop
HELLO_TIMEOUT_S = 60.0  # srun start-up and the interpreter's imports, on a busy node


class ProbeStepFailed(ExternalError):
    """The probe step did not answer, answered garbage, or exited."""


class ProbeLineLate(ProbeStepFailed):
    """No line came within the time allowed."""


class LineReader:
    """Bounded JSON lines from a file descriptor, with a deadline per line."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def read(self, timeout: float) -> Any:
        """The next line as JSON; None at the end of input; ProbeStepFailed past `timeout`."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE_BYTES:
                raise ProbeStepFailed(f"a probe line is over {MAX_LINE_BYTES} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProbeLineLate(f"no probe line within {timeout:g} s")
            with selectors.DefaultSelector() as selector:
                selector.register(self.fd, selectors.EVENT_READ)
                if not selector.select(timeout=min(left, 1.0)):
                    continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            raise ProbeStepFailed(f"a probe line is not JSON: {line[:200]!r}") from None


# -- the step (on the client host) -----------------------------------------------------------


def answer(client: httpx.Client, request: Any) -> dict[str, Any]:
    """One request, one answer; a malformed request gets an error answer, never a crash."""
    if not isinstance(request, dict):
        return {"error": "a request is a JSON object"}
    try:
        timeout = min(max(float(request.get("timeout", 1.0)), 0.05), 30.0)
    except (TypeError, ValueError):
        return {"error": "timeout must be a number"}
    chains = request.get("probe")
    if chains is not None:
        if not isinstance(chains, list) or not all(isinstance(c, list) for c in chains):
            return {"error": "probe is a list of URL lists"}
        if sum(len(c) for c in chains) > MAX_URLS:
            return {"error": f"at most {MAX_URLS} URLs per request"}
        if any(probe_item(item) is None for c in chains for item in c):
            return {"error": 'a probe item is a URL or {"url": URL, "lists": MODEL}'}
        results = [probe_chain(client, c, timeout) for c in chains]
        return {"probe": [{"ok": ok, "why": why} for ok, why in results]}
    url = request.get("fetch")
    if isinstance(url, str):
        headers = request.get("headers") or {}
        if not isinstance(headers, dict):
            return {"error": "headers is an object"}
        headers = {str(k): str(v) for k, v in headers.items()}
        text = fetch_text(url, timeout, headers, client=client, limit=MAX_TEXT_CHARS)
        return {"fetch": text}
    return {"error": "a request has probe or fetch"}


def serve(in_fd: int, out_fd: int, idle_exit_s: float = IDLE_EXIT_S) -> int:
    """Say hello (the node), then answer each request line until end of input or idleness."""

    def say(obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode() + b"\n"
        while data:
            data = data[os.write(out_fd, data) :]

    say({"hello": node_name()})
    reader = LineReader(in_fd)
    with httpx.Client(trust_env=False) as client:
        while True:
            try:
                request = reader.read(idle_exit_s)
            except ProbeLineLate:
                print("probe step: no request for a while; exiting", file=sys.stderr, flush=True)
                return 0
            except ProbeStepFailed as exc:
                print(f"probe step: {exc}; exiting", file=sys.stderr, flush=True)
                return 65
            if request is None:
                return 0
            say(answer(client, request))


def main() -> int:
    """`python -m slurmgate.runtime.steps.probe_step`: the step itself (stdin/stdout JSON lines)."""
    return serve(sys.stdin.fileno(), sys.stdout.fileno())


# -- the controller's end --------------------------------------------------------------------


class ProbeChannel:
    """The controller's end of a running probe step: a `readiness.Prober` over its pipes."""

    def __init__(self, stdin: IO[bytes], stdout: IO[bytes], describe: Callable[[], str]) -> None:
        self._stdin = stdin
        # Called for a failure message: the step's exit status and log tail.
        self._describe = describe
        self._reader = LineReader(stdout.fileno())
        self.origin = ""

    def hello(self, timeout: float = HELLO_TIMEOUT_S) -> str:
        """Wait for the step's first line: the node it runs on."""
        first = self._read(timeout)
        host = first.get("hello") if isinstance(first, dict) else None
        if not isinstance(host, str) or not host:
            raise ProbeStepFailed(f"the probe step did not say hello: {first!r}")
        self.origin = host
        return host

    def request(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        data = json.dumps(body).encode() + b"\n"
        if len(data) > MAX_LINE_BYTES:
            raise ProbeStepFailed(f"a probe request of {len(data)} bytes is too long")
        try:
            while data:
                data = data[os.write(self._stdin.fileno(), data) :]
        except (OSError, ValueError):
            raise ProbeStepFailed(f"the probe step stopped reading{self._why()}") from None
        reply = self._read(timeout)
        if not isinstance(reply, dict) or "error" in reply:
            raise ProbeStepFailed(f"the probe step refused a request: {reply!r}")
        return reply

    def probe(self, chains: list[list[ProbeItem]], timeout: float) -> list[tuple[bool, str]]:
        """Each chain of URLs probed in order on the step's node: (ready, why) per chain."""
        budget = timeout * sum(len(c) for c in chains) + 10.0  # each URL may take its timeout
        reply = self.request({"probe": chains, "timeout": timeout}, budget)
        results = reply.get("probe")
        if not isinstance(results, list) or len(results) != len(chains):
            raise ProbeStepFailed(f"the probe step answered {len(chains)} probes with {reply!r}")
        return [_verdict(r) for r in results]

    def fetch(self, url: str, headers: dict[str, str], timeout: float) -> str | None:
        reply = self.request({"fetch": url, "headers": headers, "timeout": timeout}, timeout + 10)
        text = reply.get("fetch")
        return text[:MAX_TEXT_CHARS] if isinstance(text, str) else None

    def close(self) -> None:
        """End of input: the step answers nothing more and exits on its own."""
        with contextlib.suppress(OSError):
            self._stdin.close()

    def _read(self, timeout: float) -> Any:
        line = self._reader.read(timeout)
        if line is None:
            raise ProbeStepFailed(f"the probe step exited{self._why()}")
        return line

    def _why(self) -> str:
        detail = self._describe()
        return f": {detail}" if detail else ""


def _verdict(result: Any) -> tuple[bool, str]:
    if not isinstance(result, dict):
        return False, "the probe step answered a non-object"
    return result.get("ok") is True, str(result.get("why", ""))[:200]


if __name__ == "__main__":
    sys.exit(main())
