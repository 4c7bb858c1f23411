"""Large PD bodies parsed outside the endpoint's interpreter, in one long-lived child process.

``json.loads`` holds the interpreter lock for the whole parse, so a parse in a thread of the
endpoint stalls its event loop just as long (0.3-1 s for 8 MiB of token ids). A body over
``INLINE_BYTES`` is parsed by ``pdworker.py`` instead: a child started with the endpoint (a fresh
``python -I -S``, not a fork of a process that runs threads and an event loop), which loads the
standard library and ``pd`` only. Its answer is small (the paired body only when it was rebuilt;
else the batch size, or why it cannot be paired), and a thread of the endpoint moves the bytes
through the pipes, which releases the lock. A smaller body is parsed on the event loop itself:
under 1 ms, less than a hand-over to a thread or the child costs.

- One parse at a time (the caller's semaphore): the child's memory is one body's parse.
- A parse that takes longer than ``--pd-parse-timeout`` ends in a kill: the request is answered
  413, and a new child is started at once.
- A child that dies mid-parse (killed, out of memory) fails its request with 503 and is
  replaced at once; one found dead between parses is replaced before it is used.
- ``close`` kills it with the endpoint; an endpoint that is killed leaves nothing either: the
  child ends when its stdin closes, or at once (Linux) by its parent-death signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from slurmgate.runtime.endpoint import pd
from slurmgate.runtime.endpoint.pdworker import ANSWER, REBUILT, REFUSED, REQUEST, WHITESPACE
from slurmgate.settings.handed import ENDPOINT_TOKEN, inherited

INLINE_BYTES = 16 * 1024  # bodies up to this are parsed on the event loop, larger ones in the child
_ROOT = str(Path(pd.__file__).resolve().parents[3])  # the folder that holds the package
_CODE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from slurmgate.runtime.endpoint.pdworker import main; main(int(sys.argv[2]))"
)


@dataclass(frozen=True, slots=True)
class ParseFailed:
    """A parse that ended without an answer: the status and reason the request gets."""

    status: int
    reason: str


Parsed = pd.Pairable | str | ParseFailed


class _Exchange:
    """One body sent to the child and its answer read, on the parser's I/O thread; the event
    loop's timer may kill the child meanwhile (``overrun``)."""

    def __init__(self, process: subprocess.Popen[bytes], raw: bytes, limit: float) -> None:
        self.process = process
        self.raw = raw
        self.limit = limit
        self.overran = False
        self.done = False

    def run(self) -> Parsed:
        process, raw = self.process, self.raw
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(REQUEST.pack(len(raw)))
            process.stdin.write(raw)
            process.stdin.flush()
            head = process.stdout.read(ANSWER.size)
            if len(head) < ANSWER.size:  # the child ended
                return self._failed()
            kind, items, size = ANSWER.unpack(head)
            payload = process.stdout.read(size)
            if len(payload) < size:
                return self._failed()
        except (OSError, ValueError):  # a pipe closed by the child's death, or by ``close``
            return self._failed()
        finally:
            self.done = True
        if kind == REFUSED:
            return payload.decode("utf-8", errors="replace")
        body = payload if kind == REBUILT else raw.strip(WHITESPACE)
        return pd.Pairable(body, None if items < 0 else items)

    def _failed(self) -> ParseFailed:
        end(self.process)
        if self.overran:
            return ParseFailed(
                413,
                f"the body took over {self.limit:g} s to parse (--pd-parse-timeout); "
                "send a smaller or simpler one",
            )
        return ParseFailed(
            503, "the endpoint's body parser stopped during the parse; a new one takes the next"
        )

    def overrun(self) -> None:
        """The time limit passed (the event loop's timer): kill the child if still parsing."""
        if not self.done:
            self.overran = True
            with contextlib.suppress(OSError):
                self.process.kill()


def end(process: subprocess.Popen[bytes]) -> None:
    """Kill a child, reap it and close its pipes (nothing it holds is worth waiting for)."""
    with contextlib.suppress(OSError):
        process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()


class ChildParser:
    """The child that parses large PD bodies, started with the endpoint and replaced as soon as
    it died; a thread of the endpoint does the blocking pipe I/O."""

    def __init__(self, time_limit: float) -> None:
        self.time_limit = time_limit
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0  # children started, the first one included
        self.current: _Exchange | None = None  # the parse under way
        self.closed = False
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-parser-io")

    def start(self) -> subprocess.Popen[bytes]:
        """The child, started now when there is none alive (from the event loop's thread: the
        parent-death signal follows the thread that started the child). Raises OSError."""
        process = self.process
        if process is not None and process.poll() is None:
            return process
        if process is not None:
            end(process)
        env = inherited()
        env.pop(ENDPOINT_TOKEN, None)  # the child needs no secret
        self.process = process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CODE, _ROOT, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.started += 1
        return process

    def parse(self, raw: bytes) -> asyncio.Future[Parsed]:
        """Parse one body in the child (the caller lets one parse run at a time); the future
        ends in the child's answer, or in ``ParseFailed`` when the child overran or died."""
        loop = asyncio.get_running_loop()
        try:
            if self.closed:
                raise OSError("the endpoint is stopping")
            process = self.start()
        except OSError as exc:
            failed = loop.create_future()
            failed.set_result(ParseFailed(503, f"the endpoint's body parser cannot start: {exc}"))
            return failed
        self.current = exchange = _Exchange(process, raw, self.time_limit)
        parsing = loop.run_in_executor(self.io, exchange.run)
        timer = loop.call_later(self.time_limit, exchange.overrun)

        def ended(_: asyncio.Future[Parsed]) -> None:
            timer.cancel()
            self.current = None
            if not self.closed and process.poll() is not None:
                # replaced now, so the next body does not wait for a new child to start
                with contextlib.suppress(OSError):
                    self.start()

        parsing.add_done_callback(ended)
        return parsing

    def close(self) -> None:
        """Kill the child and stop the I/O thread (a parse under way fails at once)."""
        self.closed = True
        if self.process is not None:
            end(self.process)
        self.io.shutdown(wait=False, cancel_futures=True)
