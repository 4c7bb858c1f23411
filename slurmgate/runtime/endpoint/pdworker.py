"""The PD body parser's child process: ``pd.pairable`` on each body its endpoint sends it.

The endpoint (``pdparser.py``) starts it as ``python -I -S -c`` with this module's ``main``, so
it loads the standard library and ``pd`` only: no site-packages, no endpoint, no event loop. It
reads one request at a time from its stdin and answers each on its stdout:

- a request: the body's length (8 bytes, little-endian), then the body;
- an answer: its kind (1 byte), the batch size (8 bytes, -1 for none), the payload's length
  (8 bytes), then the payload: nothing when the paired body is the request's body with its
  surrounding whitespace stripped (the common case; the endpoint strips its own copy), the
  rebuilt body otherwise, or the reason the body cannot be paired.

It ends when its stdin closes (the endpoint closed it or died) or when the endpoint dies mid-
parse (Linux: the parent-death signal, SIGKILL); a write to an endpoint gone ends it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import sys
from typing import BinaryIO

from slurmgate.runtime.endpoint import pd

REQUEST = struct.Struct("<Q")  # the body's length
ANSWER = struct.Struct("<BqQ")  # kind, items (-1: None), payload length
STRIPPED = 0  # pairable: the request's body, stripped of the whitespace around it
REBUILT = 1  # pairable: the payload is the body to pair
REFUSED = 2  # not pairable: the payload is why, UTF-8
WHITESPACE = b" \t\r\n"  # what ``pd.pairable`` strips around a plain body
PR_SET_PDEATHSIG = 1  # prctl(2)


def answer_of(raw: bytes) -> tuple[bytes, bytes]:
    """The answer's head and payload for one body: ``pd.pairable``'s result, or why it failed
    (a parse that raises, out of memory say, is a refusal; the worker lives on)."""
    try:
        ready = pd.pairable(raw)
    except Exception as exc:  # pairable raises nothing foreseen; anything else refuses the body
        ready = f"the body could not be parsed ({type(exc).__name__})"
    if isinstance(ready, str):
        payload = ready.encode("utf-8", errors="replace")
        return ANSWER.pack(REFUSED, -1, len(payload)), payload
    items = -1 if ready.items is None else ready.items
    if ready.body == raw.strip(WHITESPACE):
        return ANSWER.pack(STRIPPED, items, 0), b""
    return ANSWER.pack(REBUILT, items, len(ready.body)), ready.body


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """Answer requests until the input ends."""
    while True:
        head = requests.read(REQUEST.size)
        if len(head) < REQUEST.size:
            return
        (size,) = REQUEST.unpack(head)
        raw = requests.read(size)
        if len(raw) < size:
            return
        head, payload = answer_of(raw)
        del raw
        answers.write(head)
        answers.write(payload)
        answers.flush()
        del payload


def die_with(parent: int) -> None:
    """End this process when ``parent`` dies, even mid-parse (Linux's parent-death signal);
    elsewhere the closed stdin ends it once the parse is over."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the signal was set
        os._exit(0)


def main(parent: int) -> None:
    """Serve the endpoint ``parent`` on stdin and stdout (stray prints go to stderr)."""
    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the endpoint's to handle
    requests = os.fdopen(0, "rb", buffering=1024 * 1024)
    answers = os.fdopen(1, "wb")
    sys.stdout = sys.stderr
    with contextlib.suppress(BrokenPipeError):  # the endpoint is gone: nothing to answer
        serve(requests, answers)
    os._exit(0)
