"""Load generators for OpenAI-style endpoints: completions, and streaming chat as users see it.

Two modes. ``run_load`` (completions) is closed-loop: ``concurrency`` workers each send one
request at a time until ``duration`` seconds have passed or
``requests`` requests were sent in all, whichever comes first. A 429 answer is counted as
throttled and, when ``honour_retry_after`` is set, the worker waits the answer's Retry-After
(capped by ``max_retry_after``) before its next request, as a well-behaved client does.
Latency is measured per answered request, from sending to the last byte of the body; for
streamed requests the time to the first body chunk (time to first token) is reported too.

``run_chat_load`` streams ``/v1/chat/completions`` over SSE, closed-loop at a concurrency or
open-loop at a request rate (Poisson or constant arrivals), with prompt and output lengths
drawn from a seeded distribution (`Lengths`). It reports time to first token, inter-token
latency and end-to-end latency (p50/p90/p99), output tokens/s, requests/s, 429s and errors,
and keeps the per-request timings a server sends (llama.cpp's ``timings``) next to its own.
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from slurmgate.errors import ExternalError, InputError


@dataclass(frozen=True)
class LoadSpec:
    """What to send, how hard and for how long."""

    url: str
    path: str = "/v1/completions"
    concurrency: int = 8
    duration: float | None = 10.0
    requests: int | None = None
    body: dict[str, Any] = field(
        default_factory=lambda: {"model": "stub-model", "prompt": "hello", "max_tokens": 16}
    )
    timeout: float = 60.0
    honour_retry_after: bool = True
    max_retry_after: float = 30.0

    def check(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.duration is None and self.requests is None:
            raise ValueError("set duration or requests (or both), or the run would never end")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration must be > 0 seconds")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list; NaN when it is empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def retry_after_seconds(value: str, now: float | None = None) -> float:
    """Seconds to wait for a Retry-After value: delay-seconds or an HTTP-date; 0 if unreadable."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:
        return 0.0
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass
class LoadReport:
    """The outcome of one run; latencies in seconds."""

    sent: int
    ok: int
    throttled: int
    errors: dict[str, int]
    elapsed: float
    throughput: float
    latency_p50: float
    latency_p90: float
    latency_p99: float
    latency_max: float
    latency_mean: float
    first_byte_p50: float
    first_byte_p99: float
    retry_after_waited: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def run_load(spec: LoadSpec, clock: Callable[[], float] = time.perf_counter) -> LoadReport:
    """Drive ``spec.url + spec.path`` and report; never raises for HTTP or connection errors."""
    spec.check()
    target = spec.url.rstrip("/") + spec.path
    payload = json.dumps(spec.body).encode()
    headers = {"content-type": "application/json"}
    stream = bool(spec.body.get("stream"))
    latencies: list[float] = []
    first_bytes: list[float] = []
    errors: Counter[str] = Counter()
    counts = {"sent": 0, "throttled": 0}
    waited = [0.0]
    started = clock()
    deadline = started + spec.duration if spec.duration is not None else math.inf
    budget = spec.requests if spec.requests is not None else math.inf

    connector = aiohttp.TCPConnector(limit=spec.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while clock() < deadline and counts["sent"] < budget:
                counts["sent"] += 1
                sent_at = clock()
                try:
                    async with session.post(target, data=payload, headers=headers) as resp:
                        first_byte = None
                        if stream:
                            async for _ in resp.content.iter_any():
                                if first_byte is None:
                                    first_byte = clock()
                        else:
                            await resp.read()
                        status = resp.status
                        retry_after = resp.headers.get("retry-after")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    errors[type(exc).__name__] += 1
                    continue
                if status == 200:
                    done_at = clock()
                    latencies.append(done_at - sent_at)
                    first_bytes.append((first_byte or done_at) - sent_at)
                elif status == 429:
                    counts["throttled"] += 1
                    if spec.honour_retry_after and retry_after:
                        delay = min(retry_after_seconds(retry_after), spec.max_retry_after)
                        delay = max(0.0, min(delay, deadline - clock()))
                        waited[0] += delay
                        await asyncio.sleep(delay)
                else:
                    errors[str(status)] += 1

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    elapsed = clock() - started
    latencies.sort()
    first_bytes.sort()
    return LoadReport(
        sent=counts["sent"],
        ok=len(latencies),
        throttled=counts["throttled"],
        errors=dict(errors),
        elapsed=elapsed,
        throughput=len(latencies) / elapsed if elapsed > 0 else 0.0,
        latency_p50=percentile(latencies, 50),
        latency_p90=percentile(latencies, 90),
        latency_p99=percentile(latencies, 99),
        latency_max=latencies[-1] if latencies else math.nan,
        latency_mean=sum(latencies) / len(latencies) if latencies else math.nan,
        first_byte_p50=percentile(first_bytes, 50),
        first_byte_p99=percentile(first_bytes, 99),
        retry_after_waited=waited[0],
    )


# -- the streaming chat mode ------------------------------------------------------------------
#
# What a user of a chat endpoint measures: the time to the first token (TTFT), the gaps between
# tokens (inter-token latency, ITL), the whole request (end to end), and the output token rate,
# over requests whose prompt and output lengths vary as a real workload's do.

MAX_SSE_LINE_BYTES = 1 << 20
MAX_STREAM_BYTES = 64 << 20
MAX_TIMED_REQUESTS = 1000
MAX_REPORT_FILES = 64
MAX_REPORT_BYTES = 4 << 20
MAX_LENGTH = 1_000_000
HISTOGRAM_BUCKETS = 20
PROMPT_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "other",
    "what",
    "time",
    "up",
    "out",
    "some",
    "into",
    "could",
    "then",
    "them",
    "these",
    "two",
    "may",
)


class LoadInputError(InputError):
    """A load setting that cannot be used; the message names the option and the fix."""


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: fixed, uniform, normal or lognormal (seedable).

    Written as ``N`` (fixed), ``uniform:LO,HI``, ``normal:MEAN,STD`` or ``lognormal:MEAN,STD``
    (the mean and standard deviation of the lengths themselves). Samples are whole numbers,
    at least 1 and at most ``MAX_LENGTH``; a normal draw below 1 is drawn again.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, option: str) -> Lengths:
        raw = text.strip().lower()
        hint = f"{option} {text!r}: use N, uniform:LO,HI, normal:MEAN,STD or lognormal:MEAN,STD"
        kind, _, args = raw.partition(":")
        try:
            if not args:
                value = int(kind)
                if not 1 <= value <= MAX_LENGTH:
                    raise LoadInputError(f"{option} {text!r} must be in 1..{MAX_LENGTH}")
                return cls("fixed", float(value))
            first, sep, second = args.partition(",")
            if not sep:
                raise LoadInputError(hint)
            a, b = float(first), float(second)
        except ValueError:
            raise LoadInputError(hint) from None
        if not (math.isfinite(a) and math.isfinite(b)):
            raise LoadInputError(hint)
        if kind == "uniform":
            if not 1 <= a <= b <= MAX_LENGTH:
                raise LoadInputError(f"{option} {text!r}: need 1 <= LO <= HI <= {MAX_LENGTH}")
        elif kind in ("normal", "lognormal"):
            if not (1 <= a <= MAX_LENGTH and 0 <= b <= MAX_LENGTH):
                raise LoadInputError(
                    f"{option} {text!r}: need 1 <= MEAN <= {MAX_LENGTH} and 0 <= STD"
                )
        else:
            raise LoadInputError(hint)
        return cls(kind, a, b)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            return rng.randint(math.ceil(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
            for _ in range(64):  # truncated at 1: draw again rather than pile up at the edge
                if value >= 0.5:
                    break
                value = rng.gauss(self.a, self.b)
        else:
            sigma2 = math.log1p((self.b / self.a) ** 2)
            value = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        return min(MAX_LENGTH, max(1, round(value)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


def arrival_gaps(rate: float, arrivals: str, rng: random.Random) -> Iterator[float]:
    """Seconds between request arrivals at ``rate`` per second: exponential gaps (a Poisson
    process, as independent users arrive) or constant ones."""
    while True:
        yield rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate


def prompt_text(words: int, rng: random.Random) -> str:
    """About ``words`` tokens of text (common short words are one token each in the usual
    tokenizers); random, so no two prompts share a cached prefix."""
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(words))


@dataclass(frozen=True)
class ChatLoadSpec:
    """A streaming chat load: closed loop at ``concurrency``, or open loop at ``rate``."""

    url: str
    model: str = "stub-model"
    path: str = "/v1/chat/completions"
    concurrency: int = 8
    rate: float | None = None
    arrivals: str = "poisson"
    max_in_flight: int = 1024
    duration: float | None = 10.0
    requests: int | None = None
    prompt_tokens: Lengths = Lengths("fixed", 32.0)
    output_tokens: Lengths = Lengths("fixed", 64.0)
    seed: int = 0
    ignore_eos: bool = True
    timeout: float = 300.0
    idle_timeout: float = 60.0
    honour_retry_after: bool = True
    max_retry_after: float = 30.0
    label: str = "endpoint"
    headers: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        if self.concurrency < 1:
            raise LoadInputError("--concurrency must be >= 1")
        if self.rate is not None and not (0 < self.rate <= 100_000 and math.isfinite(self.rate)):
            raise LoadInputError("--rate must be > 0 requests per second (and at most 100000)")
        if self.arrivals not in ("poisson", "constant"):
            raise LoadInputError(f"--arrivals {self.arrivals!r}: use poisson or constant")
        if self.max_in_flight < 1:
            raise LoadInputError("--max-in-flight must be >= 1")
        if self.duration is None and self.requests is None:
            raise LoadInputError("set --duration or --requests (or both), or the run never ends")
        if self.duration is not None and self.duration <= 0:
            raise LoadInputError("--duration must be > 0 seconds")
        if self.requests is not None and self.requests < 1:
            raise LoadInputError("--requests must be >= 1")
        if self.timeout <= 0 or self.idle_timeout <= 0:
            raise LoadInputError("--timeout must be > 0 seconds")

    def body(self, rng: random.Random) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "user", "content": prompt_text(self.prompt_tokens.sample(rng), rng)}
            ],
            "max_tokens": self.output_tokens.sample(rng),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang and llama.cpp: generate max_tokens tokens
        return body


class SSEError(ExternalError):
    """A stream that broke the bounds or the protocol; its str is the error count's key."""


class SSEDecoder:
    """Incremental Server-Sent Events decoder: bytes in, each event's data out.

    Hostile input is bounded: a line longer than ``max_line`` bytes raises, fields other than
    ``data`` and comments are ignored, and CR, LF and CRLF all end a line (the SSE grammar).
    """

    def __init__(self, max_line: int = MAX_SSE_LINE_BYTES) -> None:
        self.max_line = max_line
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        buffer = self._buffer
        start = 0
        if self._skip_lf and chunk[:1] == b"\n":
            start = 1
        self._skip_lf = False
        while start < len(chunk):
            cr = chunk.find(b"\r", start)
            lf = chunk.find(b"\n", start)
            ends = [i for i in (cr, lf) if i >= 0]
            if not ends:
                buffer += chunk[start:]
                break
            end = min(ends)
            buffer += chunk[start:end]
            if len(buffer) > self.max_line:
                raise SSEError("sse_line_too_long")
            self._line(bytes(buffer), events)
            buffer.clear()
            start = end + 1
            if chunk[end : end + 1] == b"\r":
                if chunk[start : start + 1] == b"\n":
                    start += 1
                elif start == len(chunk):
                    self._skip_lf = True
        if len(buffer) > self.max_line:
            raise SSEError("sse_line_too_long")
        return events

    def _line(self, line: bytes, events: list[bytes]) -> None:
        if not line:
            if self._data:
                events.append(b"\n".join(self._data))
                self._data = []
            return
        name, colon, value = line.partition(b":")
        if name == b"data" and colon:
            self._data.append(value[1:] if value.startswith(b" ") else value)
            if sum(len(d) for d in self._data) > self.max_line:
                raise SSEError("sse_event_too_long")

    def close(self) -> list[bytes]:
        """The events still pending at the end of the stream (a last event without its blank
        line is dispatched, as servers that close right after it expect)."""
        events: list[bytes] = []
        if self._buffer:
            self._line(bytes(self._buffer), events)
            self._buffer.clear()
        self._line(b"", events)
        return events


@dataclass
class ChatResult:
    """One streamed request as the client saw it; times in seconds from sending."""

    status: int = 0
    error: str | None = None
    retry_after: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    content_chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    malformed: int = 0
    done: bool = False
    finished: bool = False
    server_timings: dict[str, float] | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    @property
    def itl(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    def take(self, data: bytes, at: float) -> None:
        """Account one event's data, received ``at`` seconds after sending."""
        if data.strip() == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.malformed += 1
            return
        if not isinstance(event, dict):
            self.malformed += 1
            return
        if event.get("error"):
            self.error = "stream_error"
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
                self.usage_tokens = tokens
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
                self.prompt_tokens = prompt
        timings = event.get("timings")
        if isinstance(timings, dict):
            self.server_timings = {
                k: float(v)
                for k, v in list(timings.items())[:32]
                if isinstance(k, str)
                and isinstance(v, int | float)
                and not isinstance(v, bool)
                and math.isfinite(v)
            }
        choices = event.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices[:8]:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(delta, dict) and not text:
                text = delta.get("reasoning_content")
            if isinstance(text, str) and text:
                self.content_chunks += 1
                if self.ttft is None:
                    self.ttft = at
                self.chunk_times.append(at)
            if choice.get("finish_reason"):
                self.finished = True


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    clock: Callable[[], float],
    max_stream_bytes: int = MAX_STREAM_BYTES,
    max_line: int = MAX_SSE_LINE_BYTES,
) -> ChatResult:
    """Send one streaming chat request and read its SSE answer within the bounds; never raises
    for what the server or the network did (the result's ``error`` says it)."""
    result = ChatResult()
    sent = clock()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.retry_after = resp.headers.get("retry-after")
                await resp.content.read(64 << 10)  # a bounded look, then the connection goes
                result.e2e = clock() - sent
                return result
            decoder = SSEDecoder(max_line)
            received = 0
            async for chunk in resp.content.iter_any():
                at = clock() - sent
                received += len(chunk)
                if received > max_stream_bytes:
                    raise SSEError("stream_too_large")
                for data in decoder.feed(chunk):
                    result.take(data, at)
                if result.error or result.done:
                    break
            for data in decoder.close():
                result.take(data, clock() - sent)
    except SSEError as exc:
        result.error = str(exc)
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as exc:
        result.error = type(exc).__name__
    result.e2e = clock() - sent
    if result.error is None and result.status == 200:
        if not (result.done or result.finished):
            result.error = "stream_ended_early"  # no [DONE] and no finish_reason: cut short
        elif result.output_tokens == 0:
            result.error = "no_tokens"
    return result


def histogram(values: list[float], buckets: int = HISTOGRAM_BUCKETS) -> dict[str, list[float]]:
    """Equal-width buckets from the smallest to the largest value: ``edges`` (buckets + 1) and
    ``counts``; empty lists without values."""
    if not values:
        return {"edges": [], "counts": []}
    low, high = min(values), max(values)
    width = (high - low) / buckets if high > low else 1.0
    counts = [0] * buckets
    for value in values:
        counts[min(buckets - 1, int((value - low) / width))] += 1
    return {
        "edges": [low + i * width for i in range(buckets + 1)],
        "counts": [float(c) for c in counts],
    }


def _stats(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def clean(value: float) -> float | None:
        return None if math.isnan(value) else value

    return {
        "p50": clean(percentile(ordered, 50)),
        "p90": clean(percentile(ordered, 90)),
        "p99": clean(percentile(ordered, 99)),
        "mean": sum(ordered) / len(ordered) if ordered else None,
    }


@dataclass
class ChatReport:
    """The outcome of a streaming chat load; latencies in seconds, ``null`` when none."""

    label: str
    mode: str
    offered_rate: float | None
    arrivals: str | None
    concurrency: int | None
    prompt_tokens_dist: str
    output_tokens_dist: str
    seed: int
    sent: int
    ok: int
    throttled: int
    errors: dict[str, int]
    malformed_events: int
    elapsed: float
    request_rate: float
    output_tokens: int
    output_token_rate: float
    prompt_tokens: int | None
    tokens_from: str
    ttft: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    e2e_histogram: dict[str, list[float]]
    retry_after_waited: float
    server_timed: list[dict[str, float]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> list[dict[str, str]]:
        """Rows for people: one per latency, then the rates and counts."""

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.1f}"

        rows = [
            {"metric": f"{name} (ms)", **{k: ms(v) for k, v in stats.items()}}
            for name, stats in (("TTFT", self.ttft), ("ITL", self.itl), ("e2e", self.e2e))
        ]
        # What a server measured of the same requests (llama.cpp's `timings`), beside what the
        # client saw: its prompt time is the floor of TTFT, its time per token the ITL's.
        for name, key in (
            ("engine's prompt time", "server_prompt_ms"),
            ("engine's time per token", "server_predicted_per_token_ms"),
        ):
            values = [row[key] / 1e3 for row in self.server_timed if key in row]
            if values:
                rows.append(
                    {"metric": f"{name} (ms)", **{k: ms(v) for k, v in _stats(values).items()}}
                )
        blank = {"p50": "", "p90": "", "p99": "", "mean": ""}
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "0"
        for name, value in (
            ("requests/s", f"{self.request_rate:.2f}"),
            (f"output tokens/s ({self.tokens_from})", f"{self.output_token_rate:.1f}"),
            ("ok / sent", f"{self.ok} / {self.sent}"),
            ("429 (throttled)", str(self.throttled)),
            ("errors", errors),
        ):
            rows.append({"metric": name, **blank, "mean": value})
        return rows

    def render(self) -> str:
        """The table as aligned text."""
        rows = self.table()
        columns = ["metric", "p50", "p90", "p99", "mean"]
        widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
        how = (
            f"rate {self.offered_rate:g}/s ({self.arrivals})"
            if self.mode == "open"
            else f"concurrency {self.concurrency}"
        )
        lines = [
            f"{self.label}: {how}, prompt {self.prompt_tokens_dist}, "
            f"output {self.output_tokens_dist} tokens, {self.elapsed:.2f} s",
            "  ".join(c.ljust(widths[c]) if c == "metric" else c.rjust(widths[c]) for c in columns),
        ]
        for row in rows:
            lines.append(
                "  ".join(
                    row[c].ljust(widths[c]) if c == "metric" else row[c].rjust(widths[c])
                    for c in columns
                )
            )
        return "\n".join(lines)


def _timed_row(result: ChatResult) -> dict[str, float]:
    itl = result.itl
    row = {
        "ttft": result.ttft or 0.0,
        "e2e": result.e2e or 0.0,
        "output_tokens": float(result.output_tokens),
        "content_chunks": float(result.content_chunks),
        "itl_mean": sum(itl) / len(itl) if itl else math.nan,
    }
    for key, value in (result.server_timings or {}).items():
        row[f"server_{key}"] = value
    return {k: v for k, v in row.items() if math.isfinite(v)}


async def run_chat_load(
    spec: ChatLoadSpec, clock: Callable[[], float] = time.perf_counter
) -> ChatReport:
    """Drive ``spec.url + spec.path`` with streaming chat requests and report what users see;
    never raises for HTTP, stream or connection errors."""
    spec.check()
    target = spec.url.rstrip("/") + spec.path
    headers = {"content-type": "application/json", **spec.headers}
    rng = random.Random(spec.seed)
    results: list[ChatResult] = []
    counts = {"sent": 0}
    waited = [0.0]
    not_before = [0.0]
    started = clock()
    deadline = started + spec.duration if spec.duration is not None else math.inf
    budget = spec.requests if spec.requests is not None else math.inf
    open_loop = spec.rate is not None
    limit = spec.max_in_flight if open_loop else spec.concurrency
    # A connection per request: every simulated user is its own client, and a server that
    # closes its connection after a stream (llama.cpp's does) never meets a stale reused one
    # (aiohttp fails that request with "Can not write request body").
    connector = aiohttp.TCPConnector(limit=limit, force_close=True)
    timeout = aiohttp.ClientTimeout(total=spec.timeout, sock_read=spec.idle_timeout)

    async def honour(result: ChatResult) -> None:
        if result.status == 429 and spec.honour_retry_after and result.retry_after:
            delay = min(retry_after_seconds(result.retry_after), spec.max_retry_after)
            delay = max(0.0, min(delay, deadline - clock()))
            if open_loop:  # arrivals pause until then: the offered load backs off, once
                until = clock() + delay
                if until > not_before[0]:
                    waited[0] += until - max(not_before[0], clock())
                    not_before[0] = until
            else:
                waited[0] += delay
                await asyncio.sleep(delay)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(body: dict[str, Any]) -> None:
            result = await stream_chat(session, target, body, headers, clock=clock)
            results.append(result)
            await honour(result)

        if not open_loop:

            async def worker() -> None:
                while clock() < deadline and counts["sent"] < budget:
                    counts["sent"] += 1
                    await one(spec.body(rng))

            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        else:
            assert spec.rate is not None
            in_flight: set[asyncio.Task[None]] = set()
            slots = asyncio.Semaphore(spec.max_in_flight)
            due = started
            gaps = arrival_gaps(spec.rate, spec.arrivals, rng)

            async def bounded(body: dict[str, Any]) -> None:
                try:
                    await one(body)
                finally:
                    slots.release()

            while counts["sent"] < budget:
                due += next(gaps)
                while True:  # a 429 met while waiting pushes this arrival back too
                    due = max(due, not_before[0])
                    wait = due - clock()
                    if due >= deadline or wait <= 0:
                        break
                    await asyncio.sleep(wait)
                if due >= deadline:
                    break
                await slots.acquire()
                counts["sent"] += 1
                task = asyncio.ensure_future(bounded(spec.body(rng)))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.gather(*in_flight)
    elapsed = clock() - started
    return _report(spec, results, counts["sent"], elapsed, waited[0])


def _report(
    spec: ChatLoadSpec, results: list[ChatResult], sent: int, elapsed: float, waited: float
) -> ChatReport:
    ok = [r for r in results if r.status == 200 and r.error is None]
    errors: Counter[str] = Counter()
    for r in results:
        if r.error is not None:
            errors[r.error] += 1
        elif r.status not in (200, 429):
            errors[str(r.status)] += 1
    from_usage = sum(1 for r in ok if r.usage_tokens is not None)
    tokens = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    return ChatReport(
        label=spec.label,
        mode="open" if spec.rate is not None else "closed",
        offered_rate=spec.rate,
        arrivals=spec.arrivals if spec.rate is not None else None,
        concurrency=None if spec.rate is not None else spec.concurrency,
        prompt_tokens_dist=spec.prompt_tokens.describe(),
        output_tokens_dist=spec.output_tokens.describe(),
        seed=spec.seed,
        sent=sent,
        ok=len(ok),
        throttled=sum(1 for r in results if r.status == 429),
        errors=dict(errors),
        malformed_events=sum(r.malformed for r in results),
        elapsed=elapsed,
        request_rate=len(ok) / elapsed if elapsed > 0 else 0.0,
        output_tokens=tokens,
        output_token_rate=tokens / elapsed if elapsed > 0 else 0.0,
        prompt_tokens=sum(prompts) if prompts else None,
        tokens_from="usage"
        if ok and from_usage == len(ok)
        else ("chunks" if not from_usage else "mixed"),
        ttft=_stats([r.ttft for r in ok if r.ttft is not None]),
        itl=_stats([gap for r in ok for gap in r.itl]),
        e2e=_stats(e2e),
        e2e_histogram=histogram(e2e),
        retry_after_waited=waited,
        server_timed=[_timed_row(r) for r in ok[:MAX_TIMED_REQUESTS] if r.server_timings],
    )


def write_report(report: ChatReport, path: Path) -> Path:
    """Write the report as JSON (atomically: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    tmp.replace(path)
    return path


def report_path_in(directory: Path, label: str) -> Path:
    """A new file for one report in a reports directory: ``loadgen-<label>-<n>.json``."""
    safe = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:40] or "endpoint"
    for n in range(1, 10_000):
        candidate = directory / f"loadgen-{safe}-{n}.json"
        if not candidate.exists():
            return candidate
    raise LoadInputError(f"{directory} already holds 9999 reports for {label!r}; clear it")


def label_for(url: str, endpoints_json: str | None) -> str:
    """The deployment whose endpoint ``url`` is, from the runtime's SLURMGATE_ENDPOINTS
    (a JSON object name → URL); else the URL's host:port."""
    try:
        endpoints = json.loads(endpoints_json) if endpoints_json else {}
    except ValueError:
        endpoints = {}
    if isinstance(endpoints, dict):
        for name, known in endpoints.items():
            if isinstance(known, str) and known.rstrip("/") == url.rstrip("/"):
                return str(name)
    return re.sub(r"^https?://", "", url).rstrip("/") or "endpoint"


def read_reports(directory: Path, warn: Callable[[str], None]) -> list[ChatReport]:
    """The chat reports a client left in ``directory``, oldest first; a file that is too big,
    unreadable or not a report is skipped with one warning (the client is outside code)."""
    from pydantic import TypeAdapter, ValidationError

    if not directory.is_dir():
        return []
    adapter = TypeAdapter(ChatReport)
    files = sorted(directory.glob("loadgen-*.json"), key=lambda f: f.stat().st_mtime)
    if len(files) > MAX_REPORT_FILES:
        warn(f"{len(files)} load reports in {directory}; publishing the last {MAX_REPORT_FILES}")
        files = files[-MAX_REPORT_FILES:]
    reports: list[ChatReport] = []
    for path in files:
        try:
            if path.stat().st_size > MAX_REPORT_BYTES:
                raise ValueError(f"larger than {MAX_REPORT_BYTES} bytes")
            reports.append(adapter.validate_json(path.read_bytes()))
        except (OSError, ValueError, ValidationError) as exc:
            reason = " ".join(str(exc).split())[:200]
            warn(f"load report {path.name} skipped: {reason}")
    return reports
