"""The stub engine in its prefill and decode roles, behind the real sglang-router in PD mode."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable

import httpx
from endpoint_helpers import Proc, free_port, wait_status

ROOM = re.compile(r"stub_server: (prefill|decode) bootstrap_room (\d+)")


def pd_pair(stub: Callable[..., Proc], *prefill_knobs: str) -> tuple[Proc, Proc, int]:
    boot = free_port()
    prefill = stub(
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(boot),
        "--log-rooms",
        *prefill_knobs,
    )
    decode = stub("--disaggregation-mode", "decode", "--log-rooms", "--tokens-per-second", "0")
    return prefill, decode, boot


def rooms(proc: Proc, side: str) -> list[int]:
    proc.popen.terminate()
    proc.wait(5)
    return [int(room) for kind, room in ROOM.findall(proc.stderr()) if kind == side]


async def test_decode_waits_for_its_prefill_and_refuses_unpaired_requests(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    prefill, decode, boot = pd_pair(stub, "--first-token-delay", "0.3")
    decode_short = stub("--disaggregation-mode", "decode", "--bootstrap-timeout", "0.3")
    for lane in (prefill, decode, decode_short):
        await wait_status(client, f"{lane.url}/health", 200)
    info = (await client.get(f"{prefill.url}/server_info")).json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == boot
    # Without the router's fields a decode lane cannot pair: a clear 400.
    alone = await client.post(f"{decode.url}/v1/completions", json={"prompt": "a"})
    assert alone.status_code == 400 and "bootstrap_room" in alone.text
    body = {"prompt": "a", "max_tokens": 3, "bootstrap_host": "127.0.0.1"}
    # A room the prefill never sees: the decode gives up after its bounded wait.
    lost = await client.post(
        f"{decode_short.url}/v1/completions",
        json={**body, "bootstrap_port": boot, "bootstrap_room": 7},
    )
    assert lost.status_code == 504 and "bootstrap_room 7" in lost.text
    # The decode sent first still answers only once the prefill (0.3 s) has run its room.
    paired = {**body, "bootstrap_port": boot, "bootstrap_room": 2**63 + 5}
    started = time.monotonic()
    decoded = asyncio.create_task(client.post(f"{decode.url}/v1/completions", json=paired))
    await asyncio.sleep(0.1)
    assert not decoded.done()
    await client.post(f"{prefill.url}/v1/completions", json=paired)
    answer = await decoded
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "tok0 tok1 tok2 "
    assert time.monotonic() - started >= 0.3
    assert rooms(decode, "decode") == [2**63 + 5]
    assert rooms(prefill, "prefill") == [2**63 + 5]


async def test_real_sglang_router_pairs_the_stub_lanes(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    prefill, decode, boot = pd_pair(stub)
    for lane in (prefill, decode):
        await wait_status(client, f"{lane.url}/health", 200)
    port = free_port()
    router = spawn(
        "sglang_router.launch_router",
        *("--pd-disaggregation", "--prefill", prefill.url, str(boot), "--decode", decode.url),
        *("--host", "127.0.0.1", "--port", str(port), "--worker-startup-check-interval", "1"),
        *("--log-level", "warn"),
        port=port,
    )
    await wait_status(client, f"{router.url}/health", 200, timeout=30)
    # The router answers /health before its workers registered; srtctl gates on /workers.
    deadline = time.monotonic() + 30
    while True:
        workers = (await client.get(f"{router.url}/workers")).json()["workers"]
        if len(workers) == 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert {(w["worker_type"], w["url"]) for w in workers} == {
        ("prefill", prefill.url),
        ("decode", decode.url),
    }
    done = await client.post(
        f"{router.url}/v1/completions",
        json={"model": "stub-model", "prompt": "hi", "max_tokens": 4},
    )
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"] == "tok0 tok1 tok2 tok3 "
    chat = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    chunks: list[str] = []
    async with client.stream(
        "POST", f"{router.url}/v1/chat/completions", json={**chat, "max_tokens": 3, "stream": True}
    ) as streamed:
        assert streamed.status_code == 200
        async for line in streamed.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
    assert chunks == ["tok0 ", "tok1 ", "tok2 "]
    router.popen.terminate()
    router.wait(10)
    # Both requests went through the pair: the decode confirmed the rooms the prefill ran.
    prefilled = rooms(prefill, "prefill")
    assert len(prefilled) == 2
    assert rooms(decode, "decode") == prefilled
