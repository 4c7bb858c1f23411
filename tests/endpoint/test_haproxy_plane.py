"""The compiled data plane: real HAProxy in front, the endpoint deciding which lanes take work."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from endpoint_helpers import (
    FAST,
    Backend,
    Scope,
    alive,
    children_of,
    endpoint_process,
    refused_url,
    running_backends,
    serve_asgi,
    until,
    waiting_metrics,
)
from pydantic import SecretStr, ValidationError

from slurmgate.runtime.endpoint.app import EndpointServer
from slurmgate.runtime.endpoint.backpressure import Lane
from slurmgate.runtime.endpoint.config import EndpointConfig, parse_config
from slurmgate.runtime.endpoint.haproxy import (
    SYNC_S,
    HAProxyPlane,
    haproxy_binary,
    read_counts,
    render_config,
    sweep_dead_directories,
)

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}
TOKEN = "tok-Secret_123"


@pytest.fixture(autouse=True)
def _haproxy_installed() -> None:
    assert haproxy_binary(), "HAProxy is not installed: run scripts/setup.sh as root"


class Running:
    """An endpoint served through HAProxy in this event loop."""

    def __init__(self, server: EndpointServer) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.port}"
        self.endpoint = server.endpoint
        assert server.plane is not None
        self.plane: HAProxyPlane = server.plane

    async def synced(self) -> None:
        """Until HAProxy has been given the lanes' current verdicts (two syncs from now)."""
        await asyncio.sleep(2.5 * SYNC_S)


@contextlib.asynccontextmanager
async def haproxy_endpoint(backends: list[str], **settings: Any) -> AsyncIterator[Running]:
    config = EndpointConfig(name="test", backends=backends, data_plane="haproxy", **settings)
    server = EndpointServer(config)
    await server.start()
    try:
        yield Running(server)
    finally:
        await server.stop()


async def post(client: httpx.AsyncClient, url: str, **headers: str) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json=BODY, headers=headers)


async def test_haproxy_forwards_spreads_and_checks_the_token(client: httpx.AsyncClient) -> None:
    a, b = Backend("a"), Backend("b")
    async with (
        running_backends(a, b) as urls,
        haproxy_endpoint(urls, token=SecretStr(TOKEN)) as ep,
    ):
        good = {"authorization": f"Bearer {TOKEN}"}
        answers = await asyncio.gather(*(post(client, ep.url, **good) for _ in range(8)))
        assert [r.status_code for r in answers] == [200] * 8
        missing = await post(client, ep.url)
        wrong = await post(client, ep.url, authorization=f"Bearer {TOKEN}x")
        health = await client.get(f"{ep.url}/health")  # probes carry no token
        await ep.synced()
        routed = [lane.plane_routed for lane in ep.endpoint.lanes]
        metrics = (await client.get(f"{ep.url}/metrics", headers=good)).text
        unauthorized = ep.endpoint.stats.rejected_unauthorized
    assert a.hits > 0 and b.hits > 0 and a.hits + b.hits == 8
    # the lanes never see the client's credential
    assert all("authorization" not in seen for seen in a.seen_headers + b.seen_headers)
    for refused in (missing, wrong):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == 'Bearer realm="slurmgate"'
        assert refused.json()["error"]["type"] == "unauthorized"
    assert health.status_code == 200 and health.json()["backends_ready"] == 2
    # HAProxy forwarded the eight; the Python plane answered the two it refused
    assert sum(routed) == 8
    assert unauthorized == 2
    # /metrics counts what HAProxy forwarded beside what the Python plane answered
    assert 'slurmgate_endpoint_haproxy_forwarded_total{endpoint="test"} 8.0' in metrics
    assert 'slurmgate_endpoint_haproxy_responses_total{class="2xx",endpoint="test"} 8.0' in metrics
    assert 'slurmgate_endpoint_requests_total{endpoint="test"} 8.0' in metrics
    assert 'slurmgate_endpoint_unauthorized_total{endpoint="test"} 2.0' in metrics


async def test_a_streamed_answer_passes_through_unbuffered(client: httpx.AsyncClient) -> None:
    first_seen = asyncio.Event()

    async def streaming(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] in ("/health", "/metrics"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        # the rest comes only once the client has the first event: a buffering proxy hangs here
        await asyncio.wait_for(first_seen.wait(), 5)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async with serve_asgi(streaming) as lane, haproxy_endpoint([lane]) as ep:
        events = []
        async with client.stream("POST", f"{ep.url}/v1/completions", json=BODY) as r:
            async for line in r.aiter_lines():
                if line:
                    events.append(line)
                    first_seen.set()
    assert events == ["data: 1", "data: 2", "data: [DONE]"]


async def test_a_slow_stream_outlives_the_client_body_timeout(client: httpx.AsyncClient) -> None:
    """HAProxy's client timeout bounds a request's body (--body-timeout), never the wait for
    the next event of an answer: that is --read-timeout's."""

    async def slow(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] not in ("/health", "/metrics"):
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await asyncio.sleep(1.5)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async with serve_asgi(slow) as lane, haproxy_endpoint([lane], body_timeout=1.0) as ep:
        r = await client.post(f"{ep.url}/v1/completions", json=BODY)
    assert (r.status_code, r.text) == (200, "data: 1\n\ndata: [DONE]\n\n")


async def test_a_full_lane_is_drained_and_all_full_answers_429_until_they_drain(
    client: httpx.AsyncClient,
) -> None:
    a = Backend("a", metrics=waiting_metrics(5))
    b = Backend("b", metrics=waiting_metrics(0))
    async with (
        running_backends(a, b) as urls,
        haproxy_endpoint(urls, max_waiting=2, retry_after=3, **FAST) as ep,
    ):
        await until(lambda: ep.plane.ready == {0: False, 1: True})
        answers = [await post(client, ep.url) for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        assert a.hits == 0 and b.hits == 6  # the full lane got nothing
        b.metrics = waiting_metrics(4)
        await until(lambda: ep.plane.ready == {0: False, 1: False})
        full = await post(client, ep.url)
        assert full.status_code == 429
        assert full.headers["retry-after"] == "3"
        error = full.json()["error"]
        assert (error["type"], error["max_waiting_requests"]) == ("rate_limit_exceeded", 2)
        a.metrics = b.metrics = waiting_metrics(0)
        await until(lambda: ep.plane.ready == {0: True, 1: True})
        again = await post(client, ep.url)
    assert again.status_code == 200


async def test_a_lane_whose_metrics_hang_keeps_taking_work(client: httpx.AsyncClient) -> None:
    """Bounded, fail-open sampling holds behind HAProxy too: a hung scrape is no full queue."""
    hung = Backend("a", metrics_hang=True)
    async with running_backends(hung) as urls, haproxy_endpoint(urls, max_waiting=0, **FAST) as ep:
        await until(lambda: ep.endpoint.lanes[0].samples_overdue >= 2)
        await ep.synced()
        codes = [(await post(client, ep.url)).status_code for _ in range(3)]
        ready = dict(ep.plane.ready)
    assert codes == [200] * 3
    assert ready == {0: True}


async def test_a_refused_connection_is_retried_on_another_lane(client: httpx.AsyncClient) -> None:
    live = Backend("live")
    async with running_backends(live) as urls, haproxy_endpoint([refused_url(), *urls]) as ep:
        # before the health probes take the dead lane out, HAProxy itself moves on
        answers = [await post(client, ep.url) for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        assert live.hits == 6
        await until(lambda: ep.plane.ready.get(0) is False, timeout=5)  # then the probes


async def test_chunked_and_oversized_bodies_take_the_python_path(
    client: httpx.AsyncClient,
) -> None:
    lane = Backend("a")
    async with running_backends(lane) as urls, haproxy_endpoint(urls, max_body_bytes=100) as ep:
        too_big = await client.post(
            f"{ep.url}/v1/completions", content=b"x" * 200, headers={"content-type": "text/plain"}
        )

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"model": '
            yield b'"m"}'

        chunked = await client.post(f"{ep.url}/v1/completions", content=chunks())
        stats = ep.endpoint.stats
    assert too_big.status_code == 413
    assert "--max-body-bytes" in too_big.json()["error"]["message"]
    assert chunked.status_code == 200
    assert lane.seen_bodies == [b'{"model": "m"}']  # the Python plane forwarded it whole
    assert (stats.rejected_too_large, stats.requests) == (1, 1)


async def test_the_token_stays_out_of_haproxys_file_argv_and_environment(
    client: httpx.AsyncClient,
) -> None:
    async with running_backends(Backend("a")) as urls:
        async with haproxy_endpoint(urls, token=SecretStr(TOKEN)) as ep:
            proc = ep.plane.proc
            assert proc is not None
            directory = ep.plane.directory
            files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
            mode = directory.stat().st_mode & 0o777
            # and yet HAProxy knows it: the right token is forwarded
            ok = await post(client, ep.url, authorization=f"Bearer {TOKEN}")
        assert ok.status_code == 200
        assert "haproxy.cfg" in files
        for where in [*files.values(), argv, environ]:
            assert TOKEN.encode() not in where
        assert mode == 0o700
        assert not directory.exists()  # removed at stop
        assert proc.poll() is not None


def test_read_counts_takes_the_lanes_rows_and_refuses_what_is_not_stat() -> None:
    lanes = [Lane(index=0, url="http://127.0.0.1:1"), Lane(index=1, url="http://127.0.0.1:2")]
    stat = (
        "# pxname,svname,qcur,qmax,scur,smax,slim,stot,status,hrsp_2xx,hrsp_5xx\n"
        "lanes,lane0,2,3,5,9,4,40,UP,30,3\n"
        "lanes,lane1,0,0,1,1,4,7,DRAIN,6,\n"
        "endpoint,lane0,9,9,9,9,9,99,UP,99,99\n"  # another backend's server of the same name
        "lanes,lane1,short\n"
        "\n"
    )
    read_counts(stat, lanes)
    assert (lanes[0].plane_active, lanes[0].plane_queued, lanes[0].requests) == (7, 2, 40)
    assert (lanes[1].plane_active, lanes[1].plane_queued, lanes[1].requests) == (1, 0, 7)
    assert lanes[0].plane_answers == {"2xx": 30, "5xx": 3}
    assert lanes[1].plane_answers == {"2xx": 6}  # an empty count is no count
    read_counts(stat.replace(",40,", ",45,"), lanes)
    assert lanes[0].requests == 45  # only what was routed since
    assert lanes[0].sent == 5 and lanes[0].held == 2
    with pytest.raises(OSError, match="no header"):
        read_counts("Unknown command\n", lanes)
    with pytest.raises(OSError, match="lacks a column"):
        read_counts("# pxname,svname\nlanes,lane0\n", lanes)


def test_config_refuses_what_haproxy_cannot_carry(capsys: pytest.CaptureFixture[str]) -> None:
    pd = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    with pytest.raises(SystemExit):
        parse_config(["--name", "x", "--listen", "127.0.0.1:0", *pd, "--data-plane", "haproxy"])
    assert "--data-plane haproxy forwards aggregated deployments only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(
            [
                "--name",
                "x",
                "--listen",
                "127.0.0.1:0",
                "--backend",
                "http://127.0.0.1:1",
                "--data-plane",
                "haproxy",
            ],
            environ={"SLURMGATE_ENDPOINT_TOKEN": "has space"},
        )
    assert "$SLURMGATE_ENDPOINT_TOKEN to be a bearer token" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--name", "x", "--listen", "127.0.0.1:0", "--data-plane", "nginx"])
    assert "--data-plane: Input should be 'python' or 'haproxy'" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        EndpointConfig(name="x", backends=["http://127.0.0.1:1"], data_plane="c")  # type: ignore[arg-type]
    config = EndpointConfig(
        name="x", backends=["http://127.0.0.1:1"], data_plane="haproxy", token=SecretStr(TOKEN)
    )
    text = render_config(config, 3, Path("/run/x"), 1024)
    assert TOKEN not in text and "secure_memcmp(proc.expected)" in text
    assert config.argv()[-2:] == ["--data-plane", "haproxy"]


async def test_haproxy_goes_with_the_endpoint_and_the_endpoint_with_haproxy() -> None:
    async with running_backends(Backend("a")) as urls:
        # a clean stop: HAProxy and its directory are gone
        async with endpoint_process(urls[0], "--data-plane", "haproxy") as (_, proc):
            (haproxy,) = children_of(proc.pid)
            directory = _directory_of(haproxy)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
            await until(lambda: not Path(f"/proc/{haproxy}").exists(), timeout=5)
            assert not directory.exists()
        # the endpoint killed outright: HAProxy dies with it
        async with endpoint_process(urls[0], "--data-plane", "haproxy") as (_, proc):
            (haproxy,) = children_of(proc.pid)
            left = _directory_of(haproxy)
            proc.kill()
            proc.wait(5)
            await until(lambda: not alive(haproxy), timeout=5)
            assert left.exists()  # no stop ran: the next endpoint sweeps it
        assert sweep_dead_directories(left.parent) == [left]
        # HAProxy killed: the endpoint stops, exit 1
        async with endpoint_process(urls[0], "--data-plane", "haproxy") as (_, proc):
            (haproxy,) = children_of(proc.pid)
            os.kill(haproxy, signal.SIGKILL)
            assert proc.wait(10) == 1


def _directory_of(haproxy: int) -> Path:
    argv = Path(f"/proc/{haproxy}/cmdline").read_bytes().decode().split("\0")
    return next(Path(arg).parent for arg in argv if arg.endswith("haproxy.cfg"))


async def test_the_listening_socket_is_handed_over_not_shared() -> None:
    """Port 0 picks a free port; only HAProxy accepts on it, this process keeps no copy."""
    async with running_backends(Backend("a")) as urls, haproxy_endpoint(urls) as ep:
        assert ep.server.port > 0
        mine = [
            fd for fd in os.listdir("/proc/self/fd") if _is_listener_on(int(fd), ep.server.port)
        ]
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{ep.url}/v1/completions", json=BODY)
    assert mine == []
    assert r.status_code == 200


def _is_listener_on(fd: int, port: int) -> bool:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return sock.type == socket.SOCK_STREAM and sock.getsockname()[1:2] == (port,)
    except (OSError, TypeError, IndexError):
        return False
    finally:
        sock.close()
