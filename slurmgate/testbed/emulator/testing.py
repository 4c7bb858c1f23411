"""A running emulator for tests and benchmarks: `with running_emulator(pools={...}) as emu:`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from slurmgate.testbed.emulator.admin import EmulatorAdmin
from slurmgate.testbed.emulator.server import BackgroundServer
from slurmgate.testbed.emulator.state import EmulatorState, build_state


@dataclass
class RunningEmulator:
    """What `running_emulator` yields: the base URL, the live state and an admin client."""

    url: str
    state: EmulatorState
    admin: EmulatorAdmin
    repo: str
    token: str

    @property
    def owner(self) -> str:
        return self.state.owner

    def runner_labels(self, runner_id: int) -> set[str]:
        """The runner's label names as the emulator holds them now."""
        with self.state.lock:
            return {name for name, _ in self.state.runners[runner_id].labels}

    def job_placement(self, job_id: int) -> tuple[str, int | None]:
        """The job's status and the runner it was dispatched to, if any."""
        with self.state.lock:
            job = self.state.jobs[job_id]
            return job.status, job.runner_id


@contextmanager
def running_emulator(
    pools: dict[str, int] | None = None,
    legacy: int = 0,
    token: str | None = None,
    *,
    repo: str = "acme/gpu-ci",
    tick_s: float = 0.05,
    **state_kwargs: Any,
) -> Iterator[RunningEmulator]:
    """Serve an emulator on a free loopback port for the `with` block; `emu.token` works with it."""
    state = build_state(repo, pools or {}, legacy, token, **state_kwargs)
    server = BackgroundServer(state, tick_s=tick_s).start()
    admin = EmulatorAdmin(server.url)
    try:
        yield RunningEmulator(server.url, state, admin, repo, token or "emulator-token")
    finally:
        admin.close()
        server.stop()
