"""The webhook relay facing the internet: bounded reads, slow clients cut off, replays, odd JSON.

The relay runs for real under uvicorn (in a thread, or as `slurmgate webhook` in a subprocess
when its memory is measured); Prefect is stood in for by a tiny HTTP server that records the
events it is sent. No Prefect server is needed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relaykit import SECRET, deliver, job_payload
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from slurmgate.github.webhook import RelayServer, RelaySettings, signature
from slurmgate.serving import ThreadedServer

MB = 1_000_000
# A well-formed signature that matches no body: the relay must read the body to know it is wrong.
FORGED = "sha256=" + "0" * 64
JOB_CAP = 1 << 20  # RelaySettings' default max_body_bytes
RELAY_COMMAND = [sys.executable, "-m", "slurmgate.cli", "webhook", "--port", "0"]


class EventSink:
    """A real HTTP server standing in for Prefect's `POST /api/events`; it keeps what it gets."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.refuse = 0  # answer this many posts with 500 first

        async def take(request: Request) -> Response:
            if self.refuse:
                self.refuse -= 1
                return Response(status_code=500)
            self.events.extend(json.loads(await request.body()))
            return Response(status_code=204)

        app = Starlette(routes=[Route("/api/events", take, methods=["POST"])])
        self.server = ThreadedServer(app)
        self.api = f"{self.server.base_url}/api"


@pytest.fixture
def sink() -> Iterator[EventSink]:
    found = EventSink()
    with found.server:
        yield found


@pytest.fixture
def relay(sink: EventSink) -> Iterator[Callable[..., RelayServer]]:
    """`relay(**limits)` -> a RelayServer (with its uvicorn limits) posting to the sink."""
    started: list[RelayServer] = []

    def start(**overrides: Any) -> RelayServer:
        server = RelayServer(
            RelaySettings(secret=SECRET, prefect_api_url=sink.api, **overrides)
        ).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class RelayProcess:
    """`slurmgate webhook` in a subprocess on a free port, so its own memory can be read."""

    def __init__(self, api: str, secret_file: Path, *flags: str) -> None:
        env = {**os.environ, "PREFECT_API_URL": api}
        env.pop("SLURMGATE_WEBHOOK_SECRET", None)
        self.proc = subprocess.Popen(
            [*RELAY_COMMAND, "--secret-file", str(secret_file), *flags],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        banner = self.proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/webhook", banner)
        assert match, banner
        self.port = int(match.group(1))
        self.url = f"http://127.0.0.1:{self.port}/webhook"
        deadline = time.monotonic() + 20
        while True:  # the banner comes once the port is bound; uvicorn starts a moment later
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the relay never answered"
                time.sleep(0.1)

    def memory_kb(self, field: str) -> int:
        """`VmRSS` (now) or `VmHWM` (peak) of the relay process, in kB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
        assert match, status
        return int(match.group(1))

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=5).json()
        return stats

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def relay_process(sink: EventSink, tmp_path: Path) -> Iterator[Callable[..., RelayProcess]]:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    started: list[RelayProcess] = []

    def start(*flags: str) -> RelayProcess:
        found = RelayProcess(sink.api, secret_file, *flags)
        started.append(found)
        return found

    yield start
    for found in started:
        found.stop()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(headers: dict[str, str]) -> bytes:
    lines = ["POST /webhook HTTP/1.1", "Host: relay", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(sock: socket.socket, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one HTTP response read off a raw socket."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the relay closed the connection without an answer: {data!r}"
        data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    status = int(top.split(b" ", 2)[1])
    declared = re.search(rb"content-length: (\d+)", top, re.IGNORECASE)
    if declared is None:  # h11's own error answers end with the connection
        return status, {}
    length = int(declared.group(1))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the relay closed the connection mid-answer"
        rest += chunk
    return status, json.loads(rest[:length]) if rest.startswith(b"{") else {}


def closed_after(sock: socket.socket, timeout_s: float) -> float:
    """Seconds until the peer closes `sock` (reads and drops whatever it sends first); inf when
    it is still open after `timeout_s`."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return float("inf")
    return time.monotonic() - started


# ---- the body is not read beyond its limits ------------------------------------------------------


def test_a_declared_oversized_body_is_refused_before_it_is_read(relay) -> None:
    """`Content-Length` over the 1 MiB cap of a job delivery: 413 as soon as the headers are in."""
    server = relay()
    with connect(server.port) as sock:
        sock.sendall(
            head(
                {
                    "Content-Length": str(200 * MB),
                    "X-GitHub-Event": "workflow_job",
                    "X-Hub-Signature-256": FORGED,
                }
            )
        )
        status, answer = read_answer(sock, timeout_s=5)  # no byte of the body was sent
        assert (status, answer["outcome"]) == (413, "too-large")
        assert str(JOB_CAP) in answer["detail"]
        assert closed_after(sock, timeout_s=5) < 5  # the unread body cannot be reused
    assert server.stats["too_large"] == 1 and server.stats["unauthorized"] == 0


def stream_chunked(port: int, total: int, headers: dict[str, str]) -> tuple[int, float]:
    """Send a `total`-byte chunked body until the peer stops it; (bytes sent, seconds)."""
    piece = b"x" * (1 << 20)
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    started = time.monotonic()
    with connect(port) as sock:
        sock.sendall(head({**headers, "Transfer-Encoding": "chunked"}))
        try:
            while sent < total:
                sock.sendall(frame)
                sent += len(piece)
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except TimeoutError:
            pytest.fail(f"the relay stopped reading but kept the connection after {sent} bytes")
    return sent, time.monotonic() - started


def test_a_streamed_unsigned_body_is_cut_off_and_memory_stays_flat(relay_process) -> None:
    """200 MB chunked (no Content-Length) under a forged signature: read up to 1 MiB, refused.

    Before the limit the relay read it all, then checked the signature: it grew by ~390 MB.
    """
    relay = relay_process()
    assert deliver(relay.url, job_payload(61001)).status_code == 202  # warm every code path
    before = relay.memory_kb("VmHWM")
    sent, _ = stream_chunked(
        relay.port, 200 * MB, {"X-GitHub-Event": "workflow_job", "X-Hub-Signature-256": FORGED}
    )
    grown_mb = (relay.memory_kb("VmHWM") - before) / 1000
    print(f"peak RSS growth on a 200 MB unsigned chunked POST: {grown_mb:.1f} MB")
    assert grown_mb < 80, f"the relay's peak memory grew {grown_mb:.0f} MB"
    assert sent < 100 * MB, f"the relay read {sent / MB:.0f} MB of an oversized body"
    stats = relay.stats()
    assert stats["too_large"] == 1 and stats["unauthorized"] == 0
    # and it still serves
    assert deliver(relay.url, job_payload(61002)).status_code == 202


def test_bodies_in_flight_share_one_memory_budget(relay) -> None:
    """Slow bodies cannot add up past `max_buffered_bytes`: the next one is told 503 (busy)."""
    server = relay(max_body_bytes=MB, max_buffered_bytes=MB + MB // 2, body_timeout_s=30)
    held = connect(server.port)
    try:
        forged = {"X-GitHub-Event": "workflow_job", "X-Hub-Signature-256": FORGED}
        held.sendall(head({**forged, "Content-Length": str(MB)}) + b"x" * (MB - 1))  # all but one
        deadline = time.monotonic() + 10
        while server.app.state.budget.held < MB - 1:
            assert time.monotonic() < deadline, "the relay never read the first body"
            time.sleep(0.05)
        busy = deliver(server.url, b"y" * (MB // 2 + 10), signature=FORGED)
        assert busy.status_code == 503 and busy.json()["outcome"] == "busy"
        held.sendall(b"x")
        status, _ = read_answer(held, timeout_s=10)
        assert status == 401  # read in full, then refused for its wrong signature
    finally:
        held.close()
    assert deliver(server.url, b"y" * (MB // 2 + 10), signature=FORGED).status_code == 401
    assert server.app.state.budget.held == 0 and server.stats["busy"] == 1


# ---- slow clients are cut off --------------------------------------------------------------------


def test_unsigned_and_ignored_uploads_are_answered_before_a_byte_is_read(relay) -> None:
    """Three unsigned 25 MB uploads, and three of events the relay ignores, hold nothing of the
    budget: each is answered from its headers alone, and a real delivery still gets through."""
    server = relay()
    sockets = [connect(server.port) for _ in range(6)]
    try:
        for n, sock in enumerate(sockets):
            headers = {"Content-Length": str(25 * MB), "X-GitHub-Event": "workflow_job"}
            if n >= 3:
                headers.update({"X-GitHub-Event": "push", "X-Hub-Signature-256": FORGED})
            sock.sendall(head(headers) + b"x" * 1000)  # the start of a body, never finished
        answers = [read_answer(sock, timeout_s=5) for sock in sockets]
        assert [(s, a["outcome"]) for s, a in answers] == [(401, "unsigned")] * 3 + [
            (202, "ignored")
        ] * 3
        assert server.app.state.budget.held == 0
        assert all(closed_after(sock, timeout_s=5) < 5 for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
    assert deliver(server.url, job_payload(61003)).status_code == 202
    assert server.stats["unauthorized"] == 3 and server.stats["ignored"] == 3


def test_forged_signatures_hold_at_most_the_job_cap_each(relay) -> None:
    """A forged signature gets a body read, but only a job delivery's 1 MiB: three at once hold
    3 MiB of the 64 MiB budget, where 25 MB bodies filled it."""
    server = relay(body_timeout_s=30)
    sockets = [connect(server.port) for _ in range(3)]
    forged = {"X-GitHub-Event": "workflow_job", "X-Hub-Signature-256": FORGED}
    try:
        for sock in sockets:
            sock.sendall(head({**forged, "Transfer-Encoding": "chunked"}))
            piece = b"x" * (JOB_CAP - 1)
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        deadline = time.monotonic() + 10
        while server.app.state.budget.held < 3 * (JOB_CAP - 1):
            assert time.monotonic() < deadline, server.app.state.budget.held
            time.sleep(0.05)
        assert server.app.state.budget.held <= 3 * JOB_CAP
        assert deliver(server.url, job_payload(61004)).status_code == 202
    finally:
        for sock in sockets:
            sock.close()


def test_slow_headers_are_cut_off_by_the_header_timeout(relay_process) -> None:
    """Slowloris: one header byte at a time (and a client that sends nothing) is closed."""
    relay = relay_process("--header-timeout", "1")
    with connect(relay.port) as silent, connect(relay.port) as trickle:
        trickle.sendall(b"POST /webhook HTTP/1.1\r\nHost: relay\r\n")
        started = time.monotonic()
        cut = False
        for byte in b"X-Slow: " + b"a" * 200:
            try:
                trickle.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.1)
            if time.monotonic() - started > 8:
                break
        trickle_s = time.monotonic() - started
        assert cut or closed_after(trickle, timeout_s=1) < 1, "a trickling head was never cut"
        assert 0.8 < trickle_s < 6, trickle_s
        # the silent one was opened before: it is long gone too
        assert closed_after(silent, timeout_s=1) < 1
    # a kept-alive connection gets the same deadline for its next request's head
    with connect(relay.port) as kept:
        body = json.dumps(job_payload(62001)).encode()
        signed = {"X-Hub-Signature-256": signature(SECRET, body), "X-GitHub-Event": "ping"}
        kept.sendall(head({**signed, "Content-Length": str(len(body))}) + body)
        assert read_answer(kept, timeout_s=5)[0] == 200
        kept.sendall(b"POST /webhook HTTP/1.1\r\n")  # starts the next head, never ends it
        assert 0.5 < closed_after(kept, timeout_s=8) < 6


def test_a_slow_body_is_answered_408_at_the_body_timeout(relay) -> None:
    server = relay(body_timeout_s=1)
    with connect(server.port) as sock:
        sock.sendall(
            head(
                {
                    "Content-Length": "1000",
                    "X-GitHub-Event": "workflow_job",
                    "X-Hub-Signature-256": FORGED,
                }
            )
        )
        started = time.monotonic()
        answered: list[tuple[int, dict[str, Any]]] = []

        def trickle() -> None:
            try:
                for _ in range(100):
                    sock.sendall(b"x" * 5)
                    time.sleep(0.1)
            except OSError:
                pass

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        answered.append(read_answer(sock, timeout_s=8))
        elapsed = time.monotonic() - started
        status, answer = answered[0]
        assert (status, answer["outcome"]) == (408, "too-slow")
        assert 0.9 < elapsed < 5, elapsed
        assert closed_after(sock, timeout_s=5) < 5
        sender.join(15)
    assert server.stats["too_slow"] == 1


def test_connections_beyond_the_limit_are_answered_503(relay) -> None:
    server = relay(max_connections=4, header_timeout_s=30)
    idle = [connect(server.port) for _ in range(4)]
    try:
        for sock in idle:
            sock.sendall(b"POST /webhook HTTP/1.1\r\n")  # heads in progress hold their slots
        time.sleep(0.3)
        assert deliver(server.url, job_payload(63001)).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while (status := deliver(server.url, job_payload(63002)).status_code) == 503:
        assert time.monotonic() < deadline, "the slots never came back"
        time.sleep(0.1)
    assert status == 202


def test_an_oversized_head_is_refused_whole_or_in_pieces(relay) -> None:
    server = relay()
    whole = httpx.post(server.url, content=b"{}", headers={"X-Junk": "a" * 64_000})
    assert (whole.status_code, whole.json()["outcome"]) == (431, "head-too-large")
    with connect(server.port) as sock:
        sock.sendall(b"POST /webhook HTTP/1.1\r\nHost: relay\r\n")
        for number in range(40):  # 40 kB of headers, a kilobyte at a time, never finished
            try:
                sock.sendall(f"X-Junk-{number}: {'a' * 1000}\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.01)
        assert read_answer(sock, timeout_s=5)[0] == 400  # h11's own cap on an unfinished head


# ---- replays: the signed body, not the unsigned delivery id, decides -----------------------------


def test_a_signed_body_replayed_under_fresh_delivery_ids_is_posted_once(relay, sink) -> None:
    server = relay()
    body = json.dumps(job_payload(64001)).encode()
    codes = [deliver(server.url, body, delivery=str(uuid.uuid4())).status_code for _ in range(3)]
    assert codes == [202, 200, 200]
    assert [e["payload"]["job_id"] for e in sink.events] == [64001]
    assert server.stats["duplicates"] == 2
    # the same job in another state is another body: it is posted
    assert deliver(server.url, job_payload(64001, "in_progress")).status_code == 202
    assert len(sink.events) == 2


def test_a_delivery_prefect_refused_is_forgotten_by_id_and_body(relay, sink) -> None:
    server = relay()
    sink.refuse = 1
    body = json.dumps(job_payload(64101)).encode()
    delivery = str(uuid.uuid4())
    assert deliver(server.url, body, delivery=delivery).status_code == 503
    assert deliver(server.url, body, delivery=delivery).status_code == 202  # GitHub redelivers
    assert deliver(server.url, body, delivery=str(uuid.uuid4())).status_code == 200
    assert len(sink.events) == 1


# ---- signed but odd payloads: 400 with one line, never a 500 -------------------------------------


def odd(mutate: Callable[[dict[str, Any]], Any]) -> bytes:
    payload = job_payload(65001)
    mutate(payload)
    return json.dumps(payload).encode()


ODD_BODIES: dict[str, tuple[bytes, str]] = {
    "array nested 100k deep": (b"[" * 100_000 + b"]" * 100_000, "body: Invalid JSON"),
    "object nested 100k deep": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "recursion"),
    "deep in a field the relay ignores": (
        odd(lambda p: p.update(sender=json.loads('{"a":' * 300 + "1" + "}" * 300))),
        "recursion",
    ),
    "labels: 5": (odd(lambda p: p["workflow_job"].update(labels=5)), "workflow_job.labels"),
    "labels of numbers": (
        odd(lambda p: p["workflow_job"].update(labels=[1, 2])),
        "workflow_job.labels.0",
    ),
    "id a string": (odd(lambda p: p["workflow_job"].update(id="65001")), "workflow_job.id"),
    "id negative": (odd(lambda p: p["workflow_job"].update(id=-1)), "workflow_job.id"),
    "id a huge number": (
        json.dumps(job_payload(65001)).replace("65001", "9" * 5000).encode(),
        "body: Invalid JSON",
    ),
    "id past a float": (
        json.dumps(job_payload(65001)).replace("65001", "1e400").encode(),
        "workflow_job.id",
    ),
    "action a number": (odd(lambda p: p.update(action=5)), "action"),
    "action odd text": (odd(lambda p: p.update(action="Queued; drop")), "action"),
    "repository a list": (odd(lambda p: p.update(repository=[])), "repository"),
    "full_name a number": (odd(lambda p: p["repository"].update(full_name=5)), "full_name"),
    "created_at not a time": (
        odd(lambda p: p["workflow_job"].update(created_at="yesterday", started_at=None)),
        "workflow_job.created_at",
    ),
    "workflow_job null": (odd(lambda p: p.update(workflow_job=None)), "workflow_job"),
    "a JSON array": (b"[1, 2]", "body"),
    "JSON null": (b"null", "body"),
    "empty": (b"", "body: Invalid JSON"),
    "not UTF-8": (b'{"action": "\xff\xfe"}', "body"),
    "not JSON": (b"not json", "body: Invalid JSON"),
}


def test_signed_odd_payloads_get_400_with_a_one_line_reason(relay, sink) -> None:
    server = relay()
    seen = {}
    for name, (body, needle) in ODD_BODIES.items():
        response = deliver(server.url, body)
        seen[name] = (response.status_code, response.json().get("outcome"))
        detail = response.json().get("detail", "")
        assert needle in detail, (name, detail)
        assert "\n" not in detail and len(detail) <= 300, (name, detail)
    assert seen == {name: (400, "bad-delivery") for name in ODD_BODIES}
    assert server.stats["bad"] == len(ODD_BODIES) and sink.events == []


SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
)
# scalars first: a wrong-typed scalar is what a hand-written check most often forgets
JSON = SCALARS | st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
FIELDS = [
    ("action",),
    ("repository",),
    ("repository", "full_name"),
    ("workflow_job",),
    *(("workflow_job", name) for name in ("id", "labels", "created_at", "name", "run_id")),
]


@pytest.fixture
def one_relay(relay) -> RelayServer:
    """One relay for all of a property test's examples (hypothesis runs them in one call)."""
    return relay()


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(where=st.sampled_from(FIELDS), value=JSON)
def test_any_signed_value_in_any_field_gets_an_answer_not_a_500(one_relay, where, value) -> None:
    payload = job_payload(66001)
    target = payload
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    response = deliver(one_relay.url, payload)
    assert response.status_code in (200, 202, 400, 403), response.text
