"""The streaming chat load generator: length distributions, SSE parsing of hostile streams,
rate accuracy, and TTFT / inter-token / end-to-end latency against real loopback servers."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from endpoint_helpers import (
    Backend,
    Proc,
    python_env,
    running_backends,
    serve_asgi,
    wait_status,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmgate.runtime.loadgen.chat import run_chat_load
from slurmgate.runtime.loadgen.report import histogram, percentile, read_reports
from slurmgate.runtime.loadgen.stream import SSEDecoder, SSEError, stream_chat
from slurmgate.runtime.loadgen.workload import (
    MAX_LENGTH,
    ChatLoadSpec,
    Lengths,
    LoadInputError,
    arrival_gaps,
)
from slurmgate.runtime.run.client import CLIENT_REPORTS_ENV

# -- length distributions -----------------------------------------------------------------


def test_lengths_parse_every_form_and_name_the_option_when_wrong() -> None:
    assert Lengths.parse("128", "--output-tokens") == Lengths("fixed", 128.0)
    assert Lengths.parse("uniform:64,256", "--x") == Lengths("uniform", 64.0, 256.0)
    assert Lengths.parse(" Normal:256,64 ", "--x") == Lengths("normal", 256.0, 64.0)
    assert Lengths.parse("lognormal:200,100", "--x").describe() == "lognormal:200,100"
    for bad in ("0", "-3", "abc", "uniform:9", "uniform:9,3", "gamma:1,2", "normal:0,1", "nan"):
        with pytest.raises(LoadInputError, match="--prompt-tokens"):
            Lengths.parse(bad, "--prompt-tokens")


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["uniform", "normal", "lognormal"]),
    a=st.integers(1, 5000),
    b=st.integers(0, 5000),
    seed=st.integers(0, 2**32),
)
def test_samples_are_whole_bounded_and_seeded(kind: str, a: int, b: int, seed: int) -> None:
    if kind == "uniform":
        a, b = min(a, max(b, 1)), max(a, b)
    dist = Lengths.parse(f"{kind}:{a},{b}", "--x")
    first = [dist.sample(random.Random(seed)) for _ in range(1)]
    rng = random.Random(seed)
    draws = [dist.sample(rng) for _ in range(50)]
    assert draws[:1] == first  # the same seed, the same lengths
    assert all(isinstance(d, int) and 1 <= d <= MAX_LENGTH for d in draws)
    if kind == "uniform":
        assert all(a <= d <= b for d in draws)


@pytest.mark.parametrize(
    ("text", "mean", "std"),
    [("normal:300,50", 300, 50), ("lognormal:300,150", 300, 150), ("uniform:100,300", 200, 57.7)],
)
def test_samples_have_the_asked_mean_and_spread(text: str, mean: float, std: float) -> None:
    rng = random.Random(7)
    draws = [Lengths.parse(text, "--x").sample(rng) for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(mean, rel=0.02)
    assert statistics.pstdev(draws) == pytest.approx(std, rel=0.05)


def test_arrival_gaps_poisson_and_constant() -> None:
    rng = random.Random(3)
    poisson = [g for g, _ in zip(arrival_gaps(20.0, "poisson", rng), range(20_000), strict=False)]
    assert statistics.fmean(poisson) == pytest.approx(0.05, rel=0.03)
    assert statistics.pstdev(poisson) == pytest.approx(0.05, rel=0.05)  # exponential: sd = mean
    constant = arrival_gaps(20.0, "constant", rng)
    assert [next(constant) for _ in range(3)] == [0.05, 0.05, 0.05]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_are_ordered_members(values: list[float]) -> None:
    ordered = sorted(values)
    p50, p90, p99 = (percentile(ordered, q) for q in (50, 90, 99))
    assert p50 <= p90 <= p99 <= ordered[-1]
    assert {p50, p90, p99} <= set(values)
    buckets = histogram(values)
    assert sum(buckets["counts"]) == len(values)
    assert len(buckets["edges"]) == len(buckets["counts"]) + 1


# -- SSE parsing --------------------------------------------------------------------------

STREAM = (
    b": keep-alive comment\r\n\r\n"
    b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
    b"event: message\rdata: line one\rdata: line two\r\r"
    b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    b"data: [DONE]"
)
EVENTS = [
    b'{"choices":[{"delta":{"content":"a"}}]}',
    b"line one\nline two",
    b'{"choices":[{"delta":{"content":"b"}}]}',
    b"[DONE]",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_sse_decoder_gives_the_same_events_however_the_bytes_are_cut(cuts: list[int]) -> None:
    decoder = SSEDecoder()
    events: list[bytes] = []
    bounds = [0, *sorted(cuts), len(STREAM)]
    for start, end in itertools.pairwise(bounds):
        events += decoder.feed(STREAM[start:end])
    events += decoder.close()
    assert events == EVENTS


def test_sse_decoder_bounds_a_line_without_an_end() -> None:
    decoder = SSEDecoder(max_line=1000)
    decoder.feed(b"data: " + b"x" * 900)
    with pytest.raises(SSEError, match="sse_line_too_long"):
        decoder.feed(b"x" * 200)
    many = SSEDecoder(max_line=1000)
    with pytest.raises(SSEError, match="sse_event_too_long"):
        many.feed(b"data: " + b"y" * 600 + b"\ndata: " + b"y" * 600 + b"\n")


def scripted(chunks: list[bytes], *, pause: float = 0.0, hang: bool = False) -> Any:
    """An ASGI server whose chat answer is these raw body chunks, ``pause`` s apart."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(pause)
        if hang:
            await asyncio.Event().wait()
        await send({"type": "http.response.body", "body": b""})

    return app


def delta(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def one_stream(app: Any, **bounds: Any) -> Any:
    async with (
        serve_asgi(app) as url,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5, sock_read=1.0)) as session,
    ):
        body = {"model": "m", "messages": [], "stream": True}
        return await stream_chat(session, url + "/v1/chat/completions", body, {}, **bounds)


async def test_hostile_streams_end_as_one_named_error_each() -> None:
    clock = asyncio.get_running_loop().time
    huge = await one_stream(
        scripted([delta("a"), b"data: " + b"z" * 5000]), clock=clock, max_line=4096
    )
    assert huge.error == "sse_line_too_long"
    flood = await one_stream(scripted([delta("a")] * 400), clock=clock, max_stream_bytes=10_000)
    assert flood.error == "stream_too_large"
    cut = await one_stream(scripted([delta("a"), delta("b")]), clock=clock)
    assert cut.error == "stream_ended_early" and cut.content_chunks == 2  # no [DONE], no finish
    stalled = await one_stream(scripted([delta("a")], hang=True), clock=clock)
    assert stalled.error == "timeout"  # the idle read timeout, not a hang
    refused = await one_stream(scripted([b'data: {"error": {"message": "boom"}}\n\n']), clock=clock)
    assert refused.error == "stream_error"
    empty = await one_stream(scripted([b"data: [DONE]\n\n"]), clock=clock)
    assert empty.error == "no_tokens"


async def test_garbage_events_are_counted_and_skipped() -> None:
    chunks = [
        b"data: not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"choices": "no"}\n\n',
        b'data: {"choices": [7, {"delta": {"content": 5}}]}\n\n',
        b"\xff\xfe binary junk\n\n",
        delta("a"),
        delta("b", "length"),
    ]
    result = await one_stream(scripted(chunks), clock=asyncio.get_running_loop().time)
    assert result.error is None
    assert result.malformed == 2
    assert (result.content_chunks, result.output_tokens, result.usage_tokens) == (2, 2, None)


async def test_tokens_come_from_usage_when_the_server_sends_it() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}
    chunks = [delta("ab"), delta("cde", "length"), b"data: " + json.dumps(usage).encode() + b"\n\n"]
    result = await one_stream(
        scripted([*chunks, b"data: [DONE]\n\n"]), clock=asyncio.get_running_loop().time
    )
    assert (result.error, result.content_chunks, result.output_tokens) == (None, 2, 5)
    assert result.prompt_tokens == 9


async def test_ttft_and_itl_follow_the_server_pace() -> None:
    app = scripted([delta("a"), delta("b"), delta("c"), delta("d", "stop")], pause=0.05)
    result = await one_stream(app, clock=asyncio.get_running_loop().time)
    assert result.error is None and result.ttft is not None and result.e2e is not None
    assert result.ttft < 0.04
    assert all(0.04 <= gap < 0.2 for gap in result.itl) and len(result.itl) == 3
    assert result.e2e >= 0.15


# -- whole runs against the stub ----------------------------------------------------------


async def test_a_closed_loop_run_against_the_stub(
    client: httpx.AsyncClient, stub: Callable[..., Proc]
) -> None:
    lane = stub("--tokens-per-second", "100", "--first-token-delay", "0.1")
    await wait_status(client, f"{lane.url}/health", 200)
    spec = ChatLoadSpec(
        url=lane.url,
        concurrency=3,
        duration=None,
        requests=9,
        prompt_tokens=Lengths.parse("uniform:10,50", "--p"),
        output_tokens=Lengths.parse("uniform:5,15", "--o"),
        seed=11,
        label="chat",
    )
    report = await run_chat_load(spec)
    assert (report.sent, report.ok, report.throttled, report.errors) == (9, 9, 0, {})
    assert report.tokens_from == "usage"
    assert 9 * 5 <= report.output_tokens <= 9 * 15
    ttft, itl, e2e = report.ttft, report.itl, report.e2e
    assert ttft["p50"] is not None and 0.1 <= ttft["p50"] < 0.5
    assert itl["mean"] == pytest.approx(0.01, abs=0.006)  # 100 tokens/s
    assert e2e["p50"] is not None and e2e["p99"] is not None
    assert ttft["p50"] + 4 * 0.01 <= e2e["p50"] <= e2e["p99"]
    assert report.output_token_rate == pytest.approx(report.output_tokens / report.elapsed)
    assert sum(report.e2e_histogram["counts"]) == 9
    assert report.render().splitlines()[0].startswith("chat: concurrency 3")


@pytest.mark.serial
@pytest.mark.parametrize("arrivals", ["constant", "poisson"])
async def test_an_open_loop_run_sends_at_the_asked_rate(
    client: httpx.AsyncClient, stub: Callable[..., Proc], arrivals: str
) -> None:
    lane = stub("--tokens-per-second", "0", "--max-concurrency", "64")
    await wait_status(client, f"{lane.url}/health", 200)
    spec = ChatLoadSpec(
        url=lane.url,
        rate=40.0,
        arrivals=arrivals,
        duration=2.0,
        seed=5,
        output_tokens=Lengths("fixed", 4),
    )
    report = await run_chat_load(spec)
    assert report.mode == "open" and report.errors == {}
    if arrivals == "constant":
        assert 78 <= report.sent <= 80  # one every 25 ms for 2 s
    else:  # Poisson with mean 80: this seed's count, within 3 sd of the mean in any case
        assert abs(report.sent - 80) <= 3 * math.sqrt(80)
    assert report.request_rate == pytest.approx(report.sent / report.elapsed)
    assert report.elapsed < 2.6


async def test_429s_are_counted_and_retry_after_pauses_the_arrivals() -> None:
    busy = Backend("busy", 429, [(b"retry-after", b"1")])
    async with running_backends(busy) as urls:
        polite = await run_chat_load(
            ChatLoadSpec(url=urls[0], rate=20.0, arrivals="constant", duration=1.5)
        )
        closed = await run_chat_load(ChatLoadSpec(url=urls[0], concurrency=1, duration=1.5))
        pushy = await run_chat_load(
            ChatLoadSpec(
                url=urls[0], rate=20.0, arrivals="constant", duration=1.5, honour_retry_after=False
            )
        )
    assert polite.ok == 0 and polite.errors == {}
    assert polite.throttled == 2  # at 50 ms, then after the 1 s pause; the run ends in the next
    assert polite.retry_after_waited >= 0.9
    assert closed.throttled == 2
    assert pushy.throttled >= 28


def test_bad_settings_name_the_option() -> None:
    with pytest.raises(LoadInputError, match="--rate"):
        ChatLoadSpec(url="http://x", rate=0).check()
    with pytest.raises(LoadInputError, match="--arrivals"):
        ChatLoadSpec(url="http://x", rate=1, arrivals="bursty").check()
    with pytest.raises(LoadInputError, match="--duration or --requests"):
        ChatLoadSpec(url="http://x", duration=None).check()


# -- the command ----------------------------------------------------------------------------


async def cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "slurmgate.cli",
        "loadgen",
        *args,
        env={**python_env(), **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_command_prints_the_table_and_leaves_the_report_for_the_flow(
    client: httpx.AsyncClient, stub: Callable[..., Proc], tmp_path: Path
) -> None:
    lane = stub("--tokens-per-second", "500")
    await wait_status(client, f"{lane.url}/health", 200)
    env = {
        CLIENT_REPORTS_ENV: str(tmp_path / "reports"),
        "SLURMGATE_ENDPOINTS": json.dumps({"chat": lane.url, "other": "http://127.0.0.1:9"}),
    }
    args = (lane.url, "--chat", "--requests", "6", "--concurrency", "2")
    code, out, err = await cli(*args, "--output-tokens", "uniform:3,9", env=env)
    assert code == 0, err
    assert out.splitlines()[0].startswith("chat: concurrency 2, prompt 32, output uniform:3,9")
    assert "TTFT (ms)" in out and "ok / sent" in out and "6 / 6" in out
    code, out, err = await cli(*args, "--json", "--report", str(tmp_path / "mine.json"), env=env)
    assert code == 0, err
    assert json.loads(out)["ok"] == 6
    assert json.loads((tmp_path / "mine.json").read_text()) == json.loads(out)
    warnings: list[str] = []
    reports = read_reports(tmp_path / "reports", warnings.append)
    assert [(r.label, r.ok, r.output_tokens_dist) for r in reports] == [
        ("chat", 6, "uniform:3,9"),
        ("chat", 6, "16"),
    ]
    assert warnings == []


async def test_the_command_sends_the_endpoint_token_from_the_environment() -> None:
    seen = Backend("seen", 200)
    async with running_backends(seen) as urls:
        env = {"SLURMGATE_ENDPOINT_TOKEN": "s3cret-token"}
        code, out, _ = await cli(urls[0], "--chat", "--requests", "1", env=env)
    assert code == 1  # a JSON answer is no stream: an error, and no request succeeded
    assert "stream_ended_early 1" in out
    assert seen.seen_headers[0]["authorization"] == "Bearer s3cret-token"
    assert json.loads(seen.seen_bodies[0])["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--chat", "--prompt-tokens", "uniform:9"], "--prompt-tokens"),
        (["--chat", "--output-tokens", "0"], "--output-tokens"),
        (["--chat", "--rate", "-1"], "--rate"),
        (["--chat", "--timeout", "0"], "--timeout"),
        (["--rate", "5"], "--rate belongs to the streaming chat mode; add --chat"),
    ],
)
async def test_bad_options_are_one_line_and_exit_2(args: list[str], named: str) -> None:
    code, _, err = await cli("http://127.0.0.1:9", *args, env={})
    assert code == 2 and named in err and err.strip().count("\n") == 0, err
