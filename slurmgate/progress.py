"""Say on stderr that something slow is starting, and how long it has taken so far.

A newcomer who sees nothing for twenty seconds assumes a hang: on a terminal the line grows by
the elapsed seconds every few seconds; in a pipe or a log it stays one line with the total.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

TICK_S = 4.0


@contextmanager
def progress(what: str, done: str = "ready", stream: TextIO | None = None) -> Iterator[None]:
    """Print `WHAT…` at once, ` N s…` every few seconds on a terminal, then ` DONE in N s`.

    When the block raises, the line ends with ` failed after N s` and the error goes on.
    """
    out = stream or sys.stderr
    started = time.monotonic()
    out.write(f"{what}…")
    out.flush()
    stop = threading.Event()
    ticker = None
    if out.isatty():

        def tick() -> None:
            while not stop.wait(TICK_S):
                out.write(f" {time.monotonic() - started:.0f} s…")
                out.flush()

        ticker = threading.Thread(target=tick, name="progress", daemon=True)
        ticker.start()
    outcome = "failed after"
    try:
        yield
        outcome = f"{done} in"
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        out.write(f" {outcome} {time.monotonic() - started:.0f} s\n")
        out.flush()
