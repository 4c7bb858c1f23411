"""ASGI apps under uvicorn: in a daemon thread, or in the foreground with the caller's signals."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Self

import uvicorn


class _OwnSignals(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM and SIGINT to the process that runs it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def quiet_server(app: Any, **options: Any) -> uvicorn.Server:
    """A uvicorn server without access logs, stopped by `should_exit`, never by its own signal
    handlers; it gives hung requests one second at shutdown. `options` go to uvicorn.Config."""
    config = uvicorn.Config(
        app,
        **{
            "access_log": False,
            "log_level": "warning",
            "timeout_graceful_shutdown": 1,  # a hung request must not hold up a stop
            **options,
        },
    )
    return _OwnSignals(config)


class ThreadedServer:
    """Binds at construction (port 0 picks a free one), serves after `start()`, until `stop()`.

    `options` go to uvicorn.Config, as in `quiet_server`."""

    what = "server"

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        self._server = quiet_server(app, **{"log_config": None, "lifespan": "on", **options})
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> Self:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.what} did not start on {self.base_url} within {timeout_s} s"
                )
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
