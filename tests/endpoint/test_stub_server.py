"""The stub model server as a real process: knobs, SSE, vLLM metrics, rendezvous and signals."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest
from endpoint_helpers import Proc, free_port, python_env, wait_status
from prometheus_client.parser import text_string_to_metric_families

STUB = "slurmgate.testbed.stub_server"


def gauges(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


async def test_serves_openai_paths_and_vllm_metrics(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub(
        "--model", "/models/llama", "--served-model-name", "llama", "--tokens-per-second", "0"
    )
    await wait_status(client, f"{lane.url}/health", 200)
    models = (await client.get(f"{lane.url}/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["llama"]
    done = (
        await client.post(f"{lane.url}/v1/completions", json={"prompt": "a", "max_tokens": 3})
    ).json()
    assert done["choices"][0]["text"] == "tok0 tok1 tok2 "
    assert done["usage"]["completion_tokens"] == 3
    chat = await client.post(
        f"{lane.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.json()["choices"][0]["message"] == {"role": "assistant", "content": "tok0 tok1 "}
    bad = await client.post(f"{lane.url}/v1/completions", content=b"not json")
    assert bad.status_code == 400
    metrics = gauges((await client.get(f"{lane.url}/metrics")).text)
    assert metrics["vllm:num_requests_waiting"] == [({"model_name": "llama"}, 0.0)]
    assert metrics["vllm:num_requests_running"] == [({"model_name": "llama"}, 0.0)]


async def test_max_concurrency_makes_requests_wait(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--max-concurrency", "1", "--tokens-per-second", "20")
    await wait_status(client, f"{lane.url}/health", 200)
    body = {"prompt": "a", "max_tokens": 6}  # 0.3 s each
    started = time.monotonic()
    tasks = [
        asyncio.create_task(client.post(f"{lane.url}/v1/completions", json=body)) for _ in range(3)
    ]
    metrics: dict[str, list[tuple[dict[str, str], float]]] = {}
    for _ in range(100):  # until all three arrived: one generating, two queued
        metrics = gauges((await client.get(f"{lane.url}/metrics")).text)
        if metrics["vllm:num_requests_waiting"][0][1] == 2.0:
            break
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    assert metrics["vllm:num_requests_running"][0][1] == 1.0
    assert metrics["vllm:num_requests_waiting"][0][1] == 2.0
    assert elapsed >= 0.85  # served one after the other


async def test_sse_streams_one_chunk_per_token_at_the_set_speed(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "20")
    await wait_status(client, f"{lane.url}/health", 200)
    arrivals: list[float] = []
    events: list[bytes] = []
    started = time.monotonic()
    body = {"prompt": "a", "max_tokens": 5, "stream": True}
    async with client.stream("POST", f"{lane.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"] == "text/event-stream"
        async for line in r.aiter_lines():
            if line:
                arrivals.append(time.monotonic() - started)
                events.append(line.encode())
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [f"tok{i} " for i in range(5)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert arrivals[-1] >= 0.25  # five tokens at 20/s, paced
    assert arrivals[-1] - arrivals[0] >= 0.15  # the first arrived long before the last


async def test_startup_delay_and_env_knobs(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    launched = time.monotonic()  # before the stub's own clock starts
    lane = stub(env={"SLURMGATE_STUB_STARTUP_DELAY": "0.8"})
    await wait_status(client, f"{lane.url}/health", 503)
    assert (await client.get(f"{lane.url}/v1/models")).status_code == 503
    await wait_status(client, f"{lane.url}/health", 200)
    # measured from the launch: on a loaded machine the first 503 may come late in the delay
    assert time.monotonic() - launched >= 0.8


async def test_hang_never_becomes_ready(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--hang")
    await wait_status(client, f"{lane.url}/health", 503)
    await asyncio.sleep(1.0)
    assert (await client.get(f"{lane.url}/health")).status_code == 503
    assert lane.popen.poll() is None


async def test_crash_after_n_requests_exits_1(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--crash-after", "2", "--tokens-per-second", "0")
    await wait_status(client, f"{lane.url}/health", 200)
    for _ in range(2):
        r = await client.post(f"{lane.url}/v1/completions", json={"max_tokens": 1})
        assert r.status_code == 200
    assert await asyncio.to_thread(lane.wait, 5) == 1


@pytest.mark.parametrize("code", [0, 3])
async def test_exit_after_with_code(
    client: httpx.AsyncClient, stub: Callable[..., Proc], code: int
) -> None:
    # long enough that a loaded machine still sees it serve before it exits
    lane = stub("--exit-after", "3", "--exit-code", str(code))
    await wait_status(client, f"{lane.url}/health", 200)
    assert await asyncio.to_thread(lane.wait, 30) == code


async def test_injected_failures_are_evenly_spread(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--fail-status", "503", "--fail-rate", "0.5", "--fail-retry-after", "2")
    await wait_status(client, f"{lane.url}/health", 200)
    rs = [await client.post(f"{lane.url}/v1/completions", json={"max_tokens": 1}) for _ in range(4)]
    assert [r.status_code for r in rs] == [200, 503, 200, 503]
    assert rs[1].headers["retry-after"] == "2"


async def test_sigterm_exits_0_within_a_second_even_mid_stream(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "5")
    await wait_status(client, f"{lane.url}/health", 200)
    body = {"prompt": "a", "max_tokens": 100, "stream": True}

    async def consume() -> None:
        async with client.stream("POST", f"{lane.url}/v1/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass

    streaming = asyncio.create_task(consume())
    await asyncio.sleep(0.4)
    started = time.monotonic()
    lane.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(lane.wait, 2) == 0
    assert time.monotonic() - started < 1.0
    streaming.cancel()
    await asyncio.gather(streaming, return_exceptions=True)


def test_accepts_the_vllm_flags_the_launcher_passes() -> None:
    port = free_port()
    argv = [
        sys.executable, "-m", STUB, "/models/x", "--served-model-name", "x", "--host", "127.0.0.1",
        "--port", str(port), "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
        "--distributed-executor-backend", "mp", "--data-parallel-backend", "mp",
        "--enable-expert-parallel", "--exit-after", "0.3", "--gpu-memory-utilization", "0.9",
    ]  # fmt: skip
    result = subprocess.run(argv, env=python_env(), capture_output=True, timeout=10, check=False)
    assert result.returncode == 0, result.stderr.decode()
    assert b"ignoring flags it does not model: --gpu-memory-utilization 0.9" in result.stderr
    typo = [sys.executable, "-m", STUB, "--crash-afer", "3"]
    result = subprocess.run(typo, env=python_env(), capture_output=True, timeout=10, check=False)
    assert result.returncode == 2
    assert b"did you mean --crash-after?" in result.stderr


def test_bad_knob_names_the_flag() -> None:
    env = python_env() | {"SLURMGATE_STUB_MAX_CONCURRENCY": "lots"}
    result = subprocess.run(
        [sys.executable, "-m", STUB, "--port", "1"],
        env=env,
        capture_output=True,
        timeout=10,
        check=False,
    )
    assert result.returncode == 2
    assert b"SLURMGATE_STUB_MAX_CONCURRENCY='lots'" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", STUB, "--fail-rate", "2"], env=python_env(), capture_output=True,
        timeout=10, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and b"--fail-rate must be between 0 and 1" in result.stderr


async def test_pipeline_head_waits_for_followers_and_dies_with_one(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    master = str(free_port())
    common = ["--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", master]
    head = stub(*common, "--node-rank", "0")
    await wait_status(client, f"{head.url}/health", 503)
    f1 = spawn(STUB, *common, "--node-rank", "1", "--headless")
    await asyncio.sleep(0.5)
    assert (await client.get(f"{head.url}/health")).status_code == 503  # 1 of 2 followers
    f2 = spawn(STUB, *common, "--node-rank", "2", "--headless")
    await wait_status(client, f"{head.url}/health", 200)
    f2.popen.kill()  # a follower dies: the head takes the replica down, and so does the sibling
    assert await asyncio.to_thread(head.wait, 5) == 1
    assert await asyncio.to_thread(f1.wait, 5) == 1


async def test_follower_exits_when_head_dies_and_when_it_never_comes(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    master = str(free_port())
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", master]
    follower = spawn(STUB, *common, "--node-rank", "1", "--headless")
    await asyncio.sleep(0.3)  # the follower starts first and keeps retrying
    head = stub(*common)
    await wait_status(client, f"{head.url}/health", 200)
    head.popen.kill()
    assert await asyncio.to_thread(follower.wait, 5) == 1
    lonely = spawn(STUB, *common, "--node-rank", "1", "--distributed-timeout-seconds", "0.5")
    started = time.monotonic()
    assert await asyncio.to_thread(lonely.wait, 5) == 1
    assert time.monotonic() - started < 3
    assert "distributed-timeout-seconds" in lonely.stderr()


async def test_follower_exits_0_on_sigterm(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    master = str(free_port())
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", master]
    head = stub(*common)
    follower = spawn(STUB, *common, "--node-rank", "1", "--headless")
    await wait_status(client, f"{head.url}/health", 200)
    follower.popen.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(follower.wait, 2) == 0
    assert await asyncio.to_thread(head.wait, 5) == 1  # its follower left: the replica is down


def test_busy_master_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        master = str(taken.getsockname()[1])
        argv = [
            sys.executable, "-m", STUB, "--port", str(free_port()), "--nnodes", "2",
            "--master-port", master,
        ]  # fmt: skip
        result = subprocess.run(
            argv, env=python_env(), capture_output=True, timeout=10, check=False
        )
    assert result.returncode == 1
    assert f"cannot listen for followers on --master-port {master}".encode() in result.stderr
    assert b"Traceback" not in result.stderr
