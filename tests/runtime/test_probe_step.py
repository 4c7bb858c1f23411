"""The probe step as a real process (no Slurm): hello, probes, fetch, bounds and its end."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slurmgate.runtime.steps import probe_step, readiness
from slurmgate.runtime.steps.probe_step import ProbeChannel, ProbeStepFailed


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, body = {
            "/health": (200, b"ok"),
            "/v1/models": (200, b'{"data": []}'),
            "/metrics": (200, b"x" * (probe_step.MAX_TEXT_CHARS + 10)),
        }.get(self.path, (503, b"no"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def step() -> Iterator[tuple[subprocess.Popen[bytes], ProbeChannel]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmgate.runtime.steps.probe_step"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        env=dict(os.environ, SLURMD_NODENAME="probe-node"),
    )
    assert proc.stdin is not None and proc.stdout is not None
    channel = ProbeChannel(proc.stdin, proc.stdout, lambda: f"status {proc.poll()}")
    yield proc, channel
    channel.close()
    proc.kill()
    proc.wait()


def test_probes_and_fetches_on_request_from_one_process(
    step: tuple[subprocess.Popen[bytes], ProbeChannel], server_url: str
) -> None:
    proc, channel = step
    assert channel.hello(timeout=30) == "probe-node"  # the node the step runs on
    chains = [
        [server_url + "/health", server_url + "/v1/models"],
        [server_url + "/health", server_url + "/nope"],
        ["http://127.0.0.1:1/health"],
    ]
    for _ in range(3):  # one process answers every poll
        verdicts = channel.probe(chains, timeout=1.0)
        assert verdicts[0] == (True, "ready")
        assert verdicts[1] == (False, "/nope: HTTP 503")
        assert verdicts[2][0] is False and verdicts[2][1].startswith("/health: Connect")
    text = channel.fetch(server_url + "/metrics", {}, 2.0)
    assert text is not None and len(text) == probe_step.MAX_TEXT_CHARS  # cut, not unbounded
    assert channel.fetch(server_url + "/nope", {}, 2.0) is None
    with pytest.raises(ProbeStepFailed, match="refused a request"):
        channel.request({"what": 1}, timeout=10)
    channel.close()  # end of input: the step exits on its own
    assert proc.wait(timeout=10) == 0


def test_wait_ready_through_the_step(
    step: tuple[subprocess.Popen[bytes], ProbeChannel], server_url: str
) -> None:
    _, channel = step
    channel.hello(timeout=30)
    target = readiness.Target(
        name="lane", base_url=server_url, deadline=time.monotonic() + 20, needed=2
    )
    dead = readiness.Target(
        name="dead", base_url="http://127.0.0.1:1", deadline=time.monotonic() + 0.5
    )
    readiness.wait_ready([target], poll_s=0.01, prober=channel)
    assert target.ready and target.streak == 2
    with pytest.raises(readiness.ReadinessTimeout, match=r"dead at http://127.0.0.1:1 \(/health"):
        readiness.wait_ready([dead], poll_s=0.05, prober=channel)


def test_a_dead_step_fails_the_next_probe_with_its_status(
    step: tuple[subprocess.Popen[bytes], ProbeChannel], server_url: str
) -> None:
    proc, channel = step
    channel.hello(timeout=30)
    proc.kill()
    proc.wait()
    with pytest.raises(ProbeStepFailed, match=r"probe step (exited|stopped reading): status -9"):
        channel.probe([[server_url + "/health"]], timeout=1.0)


def test_the_step_exits_when_no_request_comes() -> None:
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    t0 = time.monotonic()
    try:
        assert probe_step.serve(requests_r, answers_w, idle_exit_s=0.3) == 0
        assert time.monotonic() - t0 < 5
        assert os.read(answers_r, 1000).startswith(b'{"hello": ')
    finally:
        for fd in (requests_r, requests_w, answers_r, answers_w):
            os.close(fd)


def test_a_probe_can_ask_that_the_models_page_lists_a_model(
    step: tuple[subprocess.Popen[bytes], ProbeChannel], server_url: str
) -> None:
    # An engine profile's readiness (vLLM, SGLang): /v1/models answering 200 with no model in
    # it is not ready. The item travels as JSON to the step, which applies the same check.
    _, channel = step
    channel.hello(timeout=30)
    models = server_url + "/v1/models"
    verdicts = channel.probe(
        [[server_url + "/health", {"url": models, "lists": ""}], [models]], timeout=1.0
    )
    assert verdicts == [(False, "/v1/models: does not list a model yet"), (True, "ready")]
    with pytest.raises(ProbeStepFailed, match="refused a request"):
        channel.probe([[{"url": models}]], timeout=1.0)  # type: ignore[list-item]
