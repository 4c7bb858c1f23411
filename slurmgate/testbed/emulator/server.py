"""Serve the emulator with uvicorn, in the foreground or in a background thread."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from slurmgate.serving import ThreadedServer
from slurmgate.testbed.emulator.app import create_app
from slurmgate.testbed.emulator.state import EmulatorState, build_state


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


class BackgroundServer(ThreadedServer):
    """The emulator on a free loopback port in a daemon thread; `url` is its base URL."""

    what = "emulator"

    def __init__(self, state: EmulatorState, *, host: str = "127.0.0.1", tick_s: float = 0.05):
        self.state = state
        super().__init__(create_app(state, tick_s=tick_s), host)
        self.url = self.base_url
