"""The endpoint as the launcher runs it: a process with the contract's argv, ended by SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest
from endpoint_helpers import Proc, free_port, python_env, wait_status
from prometheus_client.parser import text_string_to_metric_families

from slurmgate.runtime.endpoint.config import EndpointConfig, parse_config

ENDPOINT = "slurmgate.runtime.endpoint"
STARTUP_S = 30.0  # processes started on a machine the rest of the suite keeps busy
# The same endpoint, with the same flags, as the allocation runtime starts it and as a command.
ENTRY_POINTS = pytest.mark.parametrize(
    "entry", [(ENDPOINT,), ("slurmgate.cli", "endpoint")], ids=["python-m", "slurmgate-endpoint"]
)


@ENTRY_POINTS
async def test_endpoint_process_routes_to_stubs_and_stops_on_sigterm(
    client: httpx.AsyncClient,
    stub: Callable[..., Proc],
    spawn: Callable[..., Proc],
    entry: tuple[str, ...],
) -> None:
    lanes = [stub("--tokens-per-second", "0"), stub("--tokens-per-second", "0")]
    port = free_port()
    endpoint = spawn(
        *entry, "--name", "chat", "--listen", f"127.0.0.1:{port}",
        "--backend", lanes[0].url, "--backend", lanes[1].url,
        "--max-waiting", "4", "--retry-after", "2", "--sample-interval", "0.05",
        port=port,
    )  # fmt: skip
    # Three processes start here, none waited for: on a loaded machine that alone has taken
    # over 5 s (the `slurmgate` command imports the whole CLI). The start is not what is timed.
    await wait_status(client, f"{endpoint.url}/health", 200, timeout=STARTUP_S)
    served = [
        (await client.post(f"{endpoint.url}/v1/completions", json={"max_tokens": 1})).status_code
        for _ in range(4)
    ]
    assert served == [200] * 4
    metrics = (await client.get(f"{endpoint.url}/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}  # valid exposition
    assert {"slurmgate_endpoint_requests", "slurmgate_backend_active"} <= families.keys()
    for lane in lanes:
        assert (
            f'slurmgate_backend_requests_total{{backend="{lane.url}",endpoint="chat"}} 2.0'
            in metrics
        )
    lanes[1].popen.kill()
    await wait_status(client, f"{endpoint.url}/health", 503)
    started = time.monotonic()
    endpoint.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(endpoint.wait, 5) == 0
    assert time.monotonic() - started < 2.5


@ENTRY_POINTS
def test_bad_arguments_name_the_flag(entry: tuple[str, ...]) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", *entry, *args],
            env=python_env(),
            capture_output=True,
            timeout=20,
            check=False,
        )

    bad_backend = run("--name", "d", "--listen", "127.0.0.1:1", "--backend", "localhost:8000")
    assert bad_backend.returncode == 2
    assert b"--backend" in bad_backend.stderr and b"http://HOST:PORT" in bad_backend.stderr
    assert b"Traceback" not in bad_backend.stderr
    bad_listen = run("--name", "d", "--listen", "nowhere", "--backend", "http://a:1")
    assert bad_listen.returncode == 2 and b"HOST:PORT" in bad_listen.stderr
    bad_limit = run(
        "--name", "d", "--listen", "127.0.0.1:1", "--backend", "http://a:1", "--max-waiting", "-1"
    )
    assert bad_limit.returncode == 2 and b"--max-waiting" in bad_limit.stderr


async def test_sigterm_during_a_stream_still_exits_0_promptly(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "5")
    port = free_port()
    endpoint = spawn(
        ENDPOINT, "--name", "d", "--listen", f"127.0.0.1:{port}", "--backend", lane.url, port=port
    )
    await wait_status(client, f"{endpoint.url}/health", 200, timeout=STARTUP_S)
    body = {"prompt": "a", "max_tokens": 100, "stream": True}
    got_first = asyncio.Event()

    async def consume() -> None:
        async with client.stream("POST", f"{endpoint.url}/v1/completions", json=body) as r:
            async for _ in r.aiter_raw():
                got_first.set()

    streaming = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 5)
    started = time.monotonic()
    endpoint.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(endpoint.wait, 5) == 0
    assert time.monotonic() - started < 3.0
    await asyncio.gather(streaming, return_exceptions=True)
    assert lane.popen.poll() is None  # the backend lane is not the endpoint's to stop


def test_the_flags_the_runtime_renders_parse_back_to_the_same_config() -> None:
    config = EndpointConfig(
        name="chat",
        host="0.0.0.0",
        port=17001,
        backends=["http://10.0.0.2:8000", "http://10.0.0.3:8000"],
        max_waiting=0,
        retry_after=2.5,
        backend_health_path="/v1/models",
        pool_size=8,
        first_byte_timeout=30.0,
        health_interval=0.5,
        max_body_bytes=1000,
        max_buffered_bytes=4000,
    )
    argv = config.argv()
    assert parse_config(argv) == config
    assert "--sample-interval" not in argv  # defaults are left to the endpoint
    assert parse_config(EndpointConfig(name="d", backends=["http://a:1"]).argv()).port == 0


def test_a_body_limit_over_the_buffer_budget_names_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--name", "d", "--listen", "127.0.0.1:1", "--backend", "http://a:1"]
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*argv, "--max-body-bytes", "200", "--max-buffered-bytes", "100"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-buffered-bytes" in err and "--max-body-bytes" in err


def test_a_scrape_timeout_past_the_staleness_bound_names_the_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--name", "d", "--listen", "127.0.0.1:1", "--backend", "http://a:1"]
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*argv, "--metrics-timeout", "0.95"])  # + the 0.1 s interval > 1 s
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in ("--metrics-timeout", "--sample-interval", "--stale-after"))
    config = parse_config([*argv, "--metrics-timeout", "2", "--stale-after", "3"])
    assert (config.metrics_timeout, config.stale_after) == (2.0, 3.0)
    assert parse_config([*argv, "--max-metrics-bytes", "4096"]).max_metrics_bytes == 4096
