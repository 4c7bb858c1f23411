"""Readiness needs several good probes in a row, against a real HTTP server that flaps."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slurmgate.runtime.steps import readiness


class Flapping:
    """A server whose /health answers the next status of a script (then the last one forever)."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)
        self.health_calls = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status = 200
                if self.path == "/health":
                    index = min(owner.health_calls, len(owner.script) - 1)
                    status = owner.script[index]
                    owner.health_calls += 1
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def flapping() -> Iterator[type[Flapping]]:
    made: list[Flapping] = []

    def make(script: list[int]) -> Flapping:
        server = Flapping(script)
        made.append(server)
        return server

    yield make  # type: ignore[misc]
    for server in made:
        server.server.shutdown()
        server.server.server_close()


def _target(server: Flapping, needed: int, within: float = 5.0) -> readiness.Target:
    return readiness.Target(
        name="lane", base_url=server.url, deadline=time.monotonic() + within, needed=needed
    )


def test_a_flap_restarts_the_streak(flapping) -> None:
    server = flapping([200, 503, 200, 503, 200, 200, 200])
    target = _target(server, needed=3)
    readiness.wait_ready([target], poll_s=0.01)
    assert target.ready
    # 200, 503 | 200, 503 | 200, 200, 200: ready only on the seventh probe
    assert server.health_calls == 7


def test_one_probe_is_enough_when_asked(flapping) -> None:
    server = flapping([503, 200, 503])
    target = _target(server, needed=1)
    readiness.wait_ready([target], poll_s=0.01)
    assert server.health_calls == 2


def test_a_lane_that_never_holds_its_streak_times_out_with_the_reason(flapping) -> None:
    server = flapping([200, 503] * 1000)
    target = _target(server, needed=2, within=0.5)
    reason = r"lane at .*\((/health: HTTP 503|ready 1/2 probes in a row)\)"
    with pytest.raises(readiness.ReadinessTimeout, match=reason):
        readiness.wait_ready([target], poll_s=0.01)
    assert not target.ready and server.health_calls > 4


def test_the_spec_default_is_two_probes_and_zero_is_refused() -> None:
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.runtime.spec.errors import SpecError

    data = {
        "schema_version": 1,
        "name": "probes",
        "client": {"command": ["true"]},
        "deployments": [{"name": "d", "command": ["serve"], "replicas": 1}],
    }
    assert AllocationSpec.from_data(data).deployments[0].ready_probes == 2
    data["deployments"][0]["ready_probes"] = 0  # type: ignore[index]
    with pytest.raises(SpecError, match="ready_probes"):
        AllocationSpec.from_data(data)


def test_a_rule_over_the_answer_waits_until_it_holds() -> None:
    """A frontend is ready once its JSON lists the workers (here: the third answer)."""
    answers = iter(
        ['{"stats": {"prefill_count": 0}}', "not json", '{"stats": {"prefill_count": 1}}']
    )

    class Prober:
        def probe(self, chains: list, timeout: float) -> list:
            raise AssertionError("a target with a rule is fetched, not probed")

        def fetch(self, url: str, headers: dict[str, str], timeout: float) -> str | None:
            assert url == "http://router:1/workers"
            return next(answers, None)

    target = readiness.Target(
        name="router",
        base_url="http://router:1",
        path="/workers",
        deadline=time.monotonic() + 5,
        models=False,
        accept=lambda body: body["stats"]["prefill_count"] >= 1,
    )
    readiness.wait_ready([target], poll_s=0.01, prober=Prober())
    assert target.ready

    never = readiness.Target(
        name="router",
        base_url="http://router:1",
        path="/workers",
        deadline=time.monotonic() + 0.1,
        models=False,
        accept=lambda body: False,
    )
    answers = iter(['{"stats": {}}'] * 1000)
    with pytest.raises(readiness.ReadinessTimeout, match=r"router at http://router:1 \(/workers: "):
        readiness.wait_ready([never], poll_s=0.01, prober=Prober())
