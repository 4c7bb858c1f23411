"""Serve the emulator with uvicorn, in the foreground or in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from slurmgate.emulator.app import create_app
from slurmgate.emulator.state import EmulatorState, build_state


def run_emulator(
    port: int,
    repo: str,
    pools: dict[str, int],
    legacy: int = 0,
    token: str | None = None,
    host: str = "127.0.0.1",
    *,
    announce: Callable[[str], None] | None = None,
    **state_kwargs: Any,
) -> None:
    """Build a fleet and serve it until interrupted (the `slurmgate emulator` command).

    `announce` gets the base URL once the port is bound (port 0 picks a free one).
    """
    state = build_state(repo, pools, legacy, token, **state_kwargs)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(state),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    if announce is not None:
        shown = f"[{host}]" if ":" in host else host
        announce(f"http://{shown}:{bound}")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


class BackgroundServer:
    """Uvicorn on a free loopback port in a daemon thread; `url` is set once it accepts."""

    def __init__(self, state: EmulatorState, *, host: str = "127.0.0.1", tick_s: float = 0.05):
        self.state = state
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            create_app(state, tick_s=tick_s),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,  # a hung injected write must not hold up teardown
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"emulator did not start on {self.url} within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
