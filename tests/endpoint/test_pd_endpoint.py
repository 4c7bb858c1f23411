"""The PD-aware endpoint over stub prefill and decode lanes: pairing, retries, fail-fast, limits."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable

import httpx
import pytest
from endpoint_helpers import Proc, free_port, refused_url, wait_status

from slurmgate.runtime.endpoint import pd
from slurmgate.runtime.endpoint.config import parse_config

ROOM = re.compile(r"stub_server: (prefill|decode) bootstrap_room (\d+)")


def rooms(proc: Proc, side: str) -> list[int]:
    proc.popen.terminate()
    proc.wait(5)
    return [int(room) for kind, room in ROOM.findall(proc.stderr()) if kind == side]


def prefill_lane(stub: Callable[..., Proc], *knobs: str) -> tuple[Proc, int]:
    boot = free_port()
    lane = stub(
        *("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)),
        "--log-rooms",
        *knobs,
    )
    return lane, boot


def pd_endpoint(
    spawn: Callable[..., Proc], prefill: list[tuple[str, int]], decode: list[str], *flags: str
) -> Proc:
    port = free_port()
    args = ["--name", "pd", "--listen", f"127.0.0.1:{port}"]
    for url, boot in prefill:
        args += ["--prefill", url, str(boot)]
    for url in decode:
        args += ["--decode", url]
    return spawn("slurmgate.runtime.endpoint", *args, *flags, port=port)


async def test_pairs_each_request_over_least_active_prefill_lanes_and_streams_decode(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    (p1, b1), (p2, b2) = prefill_lane(stub), prefill_lane(stub)
    decode = stub("--disaggregation-mode", "decode", "--log-rooms", "--tokens-per-second", "0")
    endpoint = pd_endpoint(spawn, [(p1.url, b1), (p2.url, b2)], [decode.url])
    await wait_status(client, f"{endpoint.url}/health", 200, timeout=20)
    for i in range(4):
        done = await client.post(
            f"{endpoint.url}/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3}
        )
        assert done.status_code == 200, done.text
        assert done.json()["choices"][0]["text"] == "tok0 tok1 tok2 "
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    pieces: list[str] = []
    async with client.stream("POST", f"{endpoint.url}/v1/chat/completions", json=chat) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        async for line in answer.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
    assert pieces == ["tok0 ", "tok1 ", "tok2 "]
    # A client's own bootstrap fields are replaced: it cannot point the decode elsewhere.
    spoofed = {
        "prompt": "x",
        "bootstrap_host": "10.9.9.9",
        "bootstrap_port": 1,
        "bootstrap_room": 3,
    }
    assert (await client.post(f"{endpoint.url}/v1/completions", json=spoofed)).status_code == 200
    endpoint.popen.terminate()
    first, second = rooms(p1, "prefill"), rooms(p2, "prefill")
    # sequential requests alternate over the idle prefill lanes (least active, rotating ties)
    assert len(first) == len(second) == 3
    assert 3 not in first + second
    assert sorted(rooms(decode, "decode")) == sorted(first + second)


async def test_a_refused_prefill_is_skipped_and_a_failing_one_answers_at_once(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    failing, boot = prefill_lane(stub, "--fail-rate", "1", "--fail-status", "503")
    decode = stub("--disaggregation-mode", "decode", "--bootstrap-timeout", "20")
    dead = refused_url()
    endpoint = pd_endpoint(spawn, [(dead, free_port()), (failing.url, boot)], [decode.url])
    await wait_status(client, f"{failing.url}/health", 200)
    await wait_status(client, f"{decode.url}/health", 200)
    await wait_status(client, f"{endpoint.url}/metrics", 200, timeout=20)
    started = time.monotonic()
    answer = await client.post(f"{endpoint.url}/v1/completions", json={"prompt": "a"})
    # the dead lane could not be connected (retried on the other prefill lane), whose 503 is
    # the answer at once: the decode, waiting for a room that never comes, is cut off
    assert answer.status_code == 503
    assert "injected failure" in answer.text
    assert time.monotonic() - started < 5
    metrics = (await client.get(f"{endpoint.url}/metrics")).text
    assert 'slurmgate_endpoint_retries_total{endpoint="pd",reason="connect"} 1.0' in metrics


async def test_per_role_backpressure_answers_429_with_retry_after(
    client: httpx.AsyncClient, stub: Callable[..., Proc], spawn: Callable[..., Proc]
) -> None:
    prefill, boot = prefill_lane(stub)
    decode = stub("--disaggregation-mode", "decode", "--max-concurrency", "1")
    endpoint = pd_endpoint(
        spawn, [(prefill.url, boot)], [decode.url], "--max-waiting", "0", "--retry-after", "3"
    )
    await wait_status(client, f"{endpoint.url}/health", 200, timeout=20)
    slow = {"prompt": "a", "max_tokens": 400}  # 0.8 s at 500 tok/s, one at a time
    running = [
        asyncio.create_task(client.post(f"{endpoint.url}/v1/completions", json=slow))
        for _ in range(2)
    ]
    await asyncio.sleep(0.5)  # the decode's sampled queue now shows the second one waiting
    busy = await client.post(f"{endpoint.url}/v1/completions", json={"prompt": "b"})
    assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
    assert busy.status_code == 429
    assert busy.headers["retry-after"] == "3"
    assert "every decode backend is over its queue limit" in busy.text


def test_flags_name_the_roles_and_refuse_mixing_them() -> None:
    config = parse_config(
        [
            *("--name", "d", "--listen", "127.0.0.1:0", "--prefill", "http://h:1", "8998"),
            *("--prefill", "http://h:2", "--decode", "http://h:3"),
        ]
    )
    assert [(p.url, p.bootstrap_port) for p in config.prefill] == [
        ("http://h:1", 8998),
        ("http://h:2", None),
    ]
    assert parse_config(config.argv()) == config
    for bad in (
        ["--backend", "http://h:1", "--prefill", "http://h:2", "--decode", "http://h:3"],
        ["--prefill", "http://h:2"],
        ["--prefill", "http://h:2", "boot", "--decode", "http://h:3"],
    ):
        with pytest.raises(SystemExit):
            parse_config(["--name", "d", "--listen", "127.0.0.1:0", *bad])


def test_paired_body_appends_the_fields_and_replaces_a_clients() -> None:
    raw = b'{"prompt": "a", "max_tokens": 2}'
    body, room = pd.paired_body(raw, json.loads(raw), "10.0.0.1", 8998)
    assert json.loads(body) == {
        "prompt": "a",
        "max_tokens": 2,
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": room,
    }
    assert 0 <= room < 2**63
    spoof = {"prompt": ["a", "b"], "bootstrap_h\u006fst": "evil", "bootstrap_room": 1}
    raw = json.dumps(spoof).replace("host", "h\\u006fst").encode()
    batched = json.loads(pd.paired_body(raw, json.loads(raw), "10.0.0.1", None)[0])
    assert batched["bootstrap_host"] == ["10.0.0.1", "10.0.0.1"]
    assert batched["bootstrap_port"] == [None, None]
    assert len(batched["bootstrap_room"]) == 2 and 1 not in batched["bootstrap_room"]
    assert json.loads(pd.paired_body(b"{}", {}, "h", 1, room=5)[0])["bootstrap_room"] == 5
    # a single request's fields come from a per-lane prefix: a port may be null, a host quoted
    single = json.loads(pd.paired_body(b' {"n": 1} ', {"n": 1}, 'h"1', None, room=7)[0])
    assert single == {"n": 1, "bootstrap_host": 'h"1', "bootstrap_port": None, "bootstrap_room": 7}
