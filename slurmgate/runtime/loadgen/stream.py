"""One streamed chat request as its user sees it: the SSE answer, bounded, and its timings.

What a user of a chat endpoint measures: the time to the first token (TTFT), the gaps between
tokens (inter-token latency, ITL) and the whole request (end to end). The stream is outside
input: its lines, its events and its total size are bounded, and what the server reports of
its own timings (llama.cpp's ``timings``) is kept beside the client's.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slurmgate.errors import ExternalError

MAX_SSE_LINE_BYTES = 1 << 20
MAX_STREAM_BYTES = 64 << 20


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
