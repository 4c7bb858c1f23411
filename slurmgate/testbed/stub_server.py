"""An OpenAI-compatible stand-in for a vLLM lane, with vLLM metrics, rendezvous and failure knobs.

With `--disaggregation-mode prefill|decode` (SGLang's flag) it plays one side of a disaggregated
pair behind a PD router (the real sglang-router or slurmgate's PD endpoint): it answers the
router's `/server_info` and `/model_info`, a prefill lane serves its bootstrap port and a decode
lane waits for its request's `bootstrap_room` there before emitting tokens (`stub_pd`).

Run it as ``python -m slurmgate.testbed.stub_server --host H --port P [knobs]``. It accepts the
vLLM flags the launcher passes (parallel sizes, node rank, master address, ``--headless``) so a
deployment spec can swap it for ``vllm serve`` without changing the launch path. Every knob can
also come from the environment as ``SLURMGATE_STUB_<KNOB>`` (for example
``SLURMGATE_STUB_STARTUP_DELAY=2``); a command-line flag wins over the environment.

Imports stay minimal (no prefect, no prometheus-client) so that a lane starts in well under a
second on a compute node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from slurmgate.errors import InputError
from slurmgate.settings.handed import handed
from slurmgate.testbed.stub_pd import (
    PairingError,
    PrefilledRooms,
    await_prefill,
    request_rooms,
    serve_bootstrap,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ENV_PREFIX = "SLURMGATE_STUB_"
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class StubSettings:
    """Everything the stub was told on its command line and in its environment."""

    model: str
    served_model_name: str
    host: str
    port: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    headless: bool
    distributed_timeout_seconds: float
    tokens_per_second: float
    first_token_delay: float
    max_concurrency: int
    startup_delay: float
    crash_after: int
    close_listener_after: int
    hang: bool
    exit_after: float
    exit_code: int
    exit_rank: int
    fail_status: int
    fail_rate: float
    fail_retry_after: str
    metrics_delay: float
    wedge_after: int
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998
    bootstrap_timeout: float = 30.0
    log_rooms: bool = False


class KnobError(InputError):
    """A knob value from the environment that cannot be used."""


def _env_default(name: str, kind: type, default: Any) -> Any:
    raw = handed(ENV_PREFIX + name.upper().replace("-", "_"))
    if raw is None or raw == "":
        return default
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise KnobError(
            f"{ENV_PREFIX}{name.upper().replace('-', '_')}={raw!r} is not a boolean: use 1 or 0"
        )
    try:
        return kind(raw)
    except ValueError:
        env = ENV_PREFIX + name.upper().replace("-", "_")
        raise KnobError(f"{env}={raw!r} is not a valid {kind.__name__}") from None


def build_parser() -> argparse.ArgumentParser:
    """The stub's command line: vLLM-compatible flags plus the stub's own knobs."""
    parser = argparse.ArgumentParser(
        prog="python -m slurmgate.testbed.stub_server",
        description="OpenAI-compatible stub model server standing in for vLLM.",
    )
    parser.add_argument("model_positional", nargs="?", default=None, help="model (as `vllm serve`)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    # vLLM flags the launcher passes; the stub honours the rendezvous ones.
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--distributed-timeout-seconds", type=float, default=600.0)
    parser.add_argument("--distributed-executor-backend", default=None)
    parser.add_argument("--data-parallel-backend", default=None)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    # SGLang's PD flags (the launcher renders them for a role lane); the stub honours them.
    parser.add_argument(
        "--disaggregation-mode", choices=("null", "prefill", "decode"), default="null"
    )
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    parser.add_argument("--disaggregation-transfer-backend", default=None)
    knobs: list[tuple[str, type, Any, str]] = [
        ("tokens-per-second", float, 500.0, "generation speed per request; <= 0 means instant"),
        ("first-token-delay", float, 0.0, "seconds before the first token (fixed latency)"),
        ("max-concurrency", int, 8, "requests generating at once; the rest wait in a queue"),
        ("startup-delay", float, 0.0, "seconds before /health turns 200"),
        ("crash-after", int, 0, "exit 1 after this many completed requests (0 = never)"),
        (
            "close-listener-after",
            int,
            0,
            "after this many completed requests the HTTP listener and its connections close "
            "while the process lives on, as an API front end that died under a live engine: "
            "new connections are refused and the lane does not exit (0 = never)",
        ),
        ("exit-after", float, 0.0, "exit with --exit-code after this many seconds (0 = never)"),
        ("exit-code", int, 0, "status used by --exit-after"),
        ("exit-rank", int, -1, "apply --exit-after/--crash-after only on this node rank"),
        ("fail-status", int, 503, "HTTP status of injected completion failures"),
        ("fail-rate", float, 0.0, "fraction of completions answered with --fail-status"),
        ("fail-retry-after", str, "", "Retry-After header on injected failures (empty = none)"),
        ("metrics-delay", float, 0.0, "seconds /metrics takes to answer, as a saturated vLLM"),
        (
            "bootstrap-timeout",
            float,
            30.0,
            "seconds a decode lane waits for its prefill's bootstrap_room (and a prefill's "
            "bootstrap server holds a decode's question)",
        ),
        (
            "wedge-after",
            int,
            0,
            "after this many completed requests the engine wedges under a live HTTP front end: "
            "/health answers 503 and every later completion hangs (0 = never)",
        ),
    ]
    for name, kind, default, help_text in knobs:
        parser.add_argument(
            f"--{name}", type=kind, default=_env_default(name, kind, default), help=help_text
        )
    parser.add_argument(
        "--log-rooms",
        action="store_true",
        default=_env_default("log_rooms", bool, False),
        help="print each prefilled and each paired bootstrap_room on stderr",
    )
    parser.add_argument(
        "--hang",
        action="store_true",
        default=_env_default("hang", bool, False),
        help="never become ready: /health answers 503 forever",
    )
    return parser


def parse_settings(argv: list[str] | None = None) -> StubSettings:
    """Parse and check the stub's flags; errors name the flag and the fix."""
    try:
        parser = build_parser()
    except KnobError as exc:
        argparse.ArgumentParser(prog="python -m slurmgate.testbed.stub_server").error(str(exc))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        # Other vLLM flags (--gpu-memory-utilization, --middleware, ...) are accepted and ignored
        # so a production command template runs unchanged; a near-miss of a stub knob is a typo.
        import difflib

        known = [opt for action in parser._actions for opt in action.option_strings]
        for arg in unknown:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--"):
                continue
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.85)
            if close:
                parser.error(f"unknown flag {flag}: did you mean {close[0]}?")
        print(
            f"stub_server: ignoring flags it does not model: {' '.join(unknown)}", file=sys.stderr
        )
    model = ns.model or ns.model_positional or "stub-model"
    checks = [
        (ns.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (0.0 <= ns.fail_rate <= 1.0, "--fail-rate must be between 0 and 1"),
        (ns.nnodes >= 1, "--nnodes must be >= 1"),
        (0 <= ns.node_rank < ns.nnodes, "--node-rank must be in [0, --nnodes)"),
        (ns.crash_after >= 0, "--crash-after must be >= 0 (0 = never)"),
        (ns.close_listener_after >= 0, "--close-listener-after must be >= 0 (0 = never)"),
        (ns.startup_delay >= 0, "--startup-delay must be >= 0"),
        (ns.exit_after >= 0, "--exit-after must be >= 0 (0 = never)"),
        (ns.first_token_delay >= 0, "--first-token-delay must be >= 0"),
        (100 <= ns.fail_status <= 599, "--fail-status must be an HTTP status (100-599)"),
        (ns.metrics_delay >= 0, "--metrics-delay must be >= 0"),
        (ns.wedge_after >= 0, "--wedge-after must be >= 0 (0 = never)"),
        (ns.bootstrap_timeout > 0, "--bootstrap-timeout must be > 0"),
        (
            1 <= ns.disaggregation_bootstrap_port <= 65535,
            "--disaggregation-bootstrap-port must be a TCP port (1-65535)",
        ),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return StubSettings(
        model=model,
        served_model_name=ns.served_model_name or model,
        host=ns.host,
        port=ns.port,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        headless=ns.headless or ns.node_rank > 0,
        distributed_timeout_seconds=ns.distributed_timeout_seconds,
        tokens_per_second=ns.tokens_per_second,
        first_token_delay=ns.first_token_delay,
        max_concurrency=ns.max_concurrency,
        startup_delay=ns.startup_delay,
        crash_after=ns.crash_after,
        close_listener_after=ns.close_listener_after,
        hang=ns.hang,
        exit_after=ns.exit_after,
        exit_code=ns.exit_code,
        exit_rank=ns.exit_rank,
        fail_status=ns.fail_status,
        fail_rate=ns.fail_rate,
        fail_retry_after=ns.fail_retry_after,
        metrics_delay=ns.metrics_delay,
        wedge_after=ns.wedge_after,
        disaggregation_mode=ns.disaggregation_mode,
        bootstrap_port=ns.disaggregation_bootstrap_port,
        bootstrap_timeout=ns.bootstrap_timeout,
        log_rooms=ns.log_rooms,
    )


def _die(code: int, reason: str) -> None:
    """Leave at once, like a crashed engine: sockets close, followers and clients notice."""
    print(f"stub_server: exiting {code}: {reason}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class StubState:
    """Queue, readiness and counters of one stub lane."""

    def __init__(self, settings: StubSettings) -> None:
        self.settings = settings
        self.started = time.monotonic()
        self.followers: set[int] = set()
        self.waiting = 0
        self.running = 0
        self.completed = 0
        self.answered: dict[int, int] = {}  # completion requests by the status answered
        self.listener_closed = asyncio.Event()
        self._fail_credit = 0.0
        self.slots = asyncio.Semaphore(settings.max_concurrency)
        self.rooms = PrefilledRooms(settings.log_rooms)
        self.paired = 0  # decode requests whose prefill's bootstrap room was confirmed

    @property
    def applies_exit_knobs(self) -> bool:
        return self.settings.exit_rank < 0 or self.settings.exit_rank == self.settings.node_rank

    @property
    def wedged(self) -> bool:
        return 0 < self.settings.wedge_after <= self.completed

    def ready(self) -> bool:
        s = self.settings
        if s.hang or self.wedged:
            return False
        if time.monotonic() - self.started < s.startup_delay:
            return False
        return len(self.followers) >= s.nnodes - 1

    def should_fail(self) -> bool:
        """Deterministic failure injection: exactly fail_rate of the requests, evenly spread."""
        if self.settings.fail_rate <= 0:
            return False
        self._fail_credit += self.settings.fail_rate
        if self._fail_credit >= 1.0 - 1e-9:
            self._fail_credit -= 1.0
            return True
        return False

    def request_done(self) -> None:
        self.completed += 1
        crash_after = self.settings.crash_after
        if crash_after and self.applies_exit_knobs and self.completed >= crash_after:
            asyncio.get_running_loop().call_soon(_die, 1, f"crash-after {crash_after} requests")
        close_after = self.settings.close_listener_after
        if close_after and self.completed >= close_after and not self.listener_closed.is_set():
            self.listener_closed.set()

    def answer(self, status: int) -> None:
        self.answered[status] = self.answered.get(status, 0) + 1

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self.slots.release()

    async def acquire_slot(self) -> contextlib.AbstractContextManager[None]:
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        return self._running()

    def metrics_text(self) -> str:
        name = self.settings.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{name}"}} {float(self.running)}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{name}"}} {float(self.waiting)}\n'
            "# HELP slurmgate_stub_requests_total Completion requests answered, by status "
            "(the stub's own counter, not a vLLM metric).\n"
            "# TYPE slurmgate_stub_requests_total counter\n"
            + "".join(
                f'slurmgate_stub_requests_total{{status="{status}"}} {float(count)}\n'
                for status, count in sorted(self.answered.items())
            )
            + "# HELP slurmgate_stub_bootstrap_rooms_total Bootstrap rooms prefilled (prefill "
            "lane) or paired with their prefill (decode lane).\n"
            "# TYPE slurmgate_stub_bootstrap_rooms_total counter\n"
            f'slurmgate_stub_bootstrap_rooms_total{{side="prefill"}} {self.rooms.prefilled:.1f}\n'
            f'slurmgate_stub_bootstrap_rooms_total{{side="decode"}} {self.paired:.1f}\n'
        )

    def server_info(self) -> dict[str, Any]:
        """What SGLang's /server_info tells a router (the fields sglang-router reads)."""
        s = self.settings
        info: dict[str, Any] = {
            "model_path": s.model,
            "served_model_name": s.served_model_name,
            "tp_size": s.tensor_parallel_size,
            "dp_size": 1,
            "disaggregation_mode": s.disaggregation_mode,
        }
        if s.disaggregation_mode == "prefill":
            info["disaggregation_bootstrap_port"] = s.bootstrap_port
        return info


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client went away")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(
    send: Send, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + extra})
    await send({"type": "http.response.body", "body": body})


async def _json(
    send: Send, status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    await _respond(send, status, json.dumps(payload).encode(), b"application/json", extra or [])


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


class StubApp:
    """The stub's ASGI application."""

    def __init__(self, state: StubState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        state = self.state
        if path == "/health" and method == "GET":
            if state.ready():
                await _respond(send, 200, b"", b"text/plain", [])
            else:
                await _json(send, 503, _error("not ready", "service_unavailable", 503))
        elif path == "/metrics" and method == "GET":
            if state.settings.metrics_delay:
                await asyncio.sleep(state.settings.metrics_delay)
            await _respond(
                send, 200, state.metrics_text().encode(), b"text/plain; version=0.0.4", []
            )
        elif path == "/v1/models" and method == "GET":
            if not state.ready():
                await _json(send, 503, _error("not ready", "service_unavailable", 503))
                return
            name = state.settings.served_model_name
            card = {"id": name, "object": "model", "created": 0, "owned_by": "slurmgate-stub"}
            await _json(
                send, 200, {"object": "list", "data": [{**card, "root": state.settings.model}]}
            )
        elif path in ("/server_info", "/get_server_info") and method == "GET":
            await _json(send, 200, state.server_info())
        elif path in ("/model_info", "/get_model_info") and method == "GET":
            info = {"model_path": state.settings.model, "is_generation": True}
            await _json(send, 200, info)
        elif path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            await self._generate(scope, receive, send, chat=path.endswith("chat/completions"))
        else:
            await _json(send, 404, _error(f"no route {method} {path}", "not_found", 404))

    async def _generate(self, scope: Scope, receive: Receive, send: Send, *, chat: bool) -> None:
        state = self.state
        settings = state.settings
        try:
            raw = await _read_body(receive)
        except ConnectionResetError:
            return
        if state.wedged:
            await asyncio.Event().wait()  # the engine is stuck: no answer, ever
        if not state.ready():
            state.answer(503)
            await _json(send, 503, _error("not ready", "service_unavailable", 503))
            return
        try:
            request = json.loads(raw or b"{}")
            if not isinstance(request, dict):
                raise ValueError("body must be a JSON object")
            # sglang-router turns a chat request's max_tokens into max_completion_tokens
            limit = request.get("max_tokens") or request.get("max_completion_tokens")
            max_tokens = int(limit or 16)
            if max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
            mode = settings.disaggregation_mode
            rooms = request_rooms(request, required=mode == "decode")
        except (ValueError, TypeError) as exc:
            state.answer(400)
            await _json(send, 400, _error(f"bad request: {exc}", "invalid_request_error", 400))
            return
        except PairingError as exc:
            state.answer(exc.status)
            await _json(send, exc.status, _error(str(exc), "invalid_request_error", exc.status))
            return
        if state.should_fail():
            extra = []
            if settings.fail_retry_after:
                extra.append((b"retry-after", settings.fail_retry_after.encode()))
            status = settings.fail_status
            state.answer(status)
            await _json(send, status, _error("injected failure", "stub_failure", status), extra)
            return
        if mode == "decode":
            state.waiting += 1  # waiting for the KV cache counts as queued, as in SGLang
            try:
                await await_prefill(request, rooms, settings.bootstrap_timeout, settings.log_rooms)
            except PairingError as exc:
                state.answer(exc.status)
                await _json(send, exc.status, _error(str(exc), "pairing_failed", exc.status))
                return
            finally:
                state.waiting -= 1
            state.paired += 1
        elif mode == "prefill":
            max_tokens = 1  # the prefill computes the KV cache and one token; decode the rest
        stream = bool(request.get("stream"))
        model = str(request.get("model") or settings.served_model_name)
        per_token = 1.0 / settings.tokens_per_second if settings.tokens_per_second > 0 else 0.0
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{id(scope):x}{state.completed}"
        obj = "chat.completion" if chat else "text_completion"
        slot = await state.acquire_slot()
        state.answer(200)
        with slot:
            if settings.first_token_delay:
                await asyncio.sleep(settings.first_token_delay)
            if mode == "prefill":
                state.rooms.done(rooms)  # the KV cache is on its way: the decode may start
                per_token = 0.0
            if not stream:
                if per_token:
                    await asyncio.sleep(per_token * max_tokens)
                text = "".join(f"tok{i} " for i in range(max_tokens))
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                prompt = request.get("prompt") if not chat else request.get("messages")
                prompt_tokens = len(json.dumps(prompt).split()) if prompt else 0
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens,
                    "total_tokens": prompt_tokens + max_tokens,
                }
                payload = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
                await _json(send, 200, payload)
            else:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-cache"),
                        ],
                    }
                )
                chunk_obj = "chat.completion.chunk" if chat else "text_completion"
                for i in range(max_tokens):
                    if per_token:
                        await asyncio.sleep(per_token)
                    last = i == max_tokens - 1
                    piece: dict[str, Any] = {
                        "index": 0,
                        "finish_reason": "length" if last else None,
                    }
                    if chat:
                        piece["delta"] = {"content": f"tok{i} "}
                        if i == 0:
                            piece["delta"]["role"] = "assistant"
                    else:
                        piece["text"] = f"tok{i} "
                    event = {
                        "id": rid,
                        "object": chunk_obj,
                        "created": created,
                        "model": model,
                        "choices": [piece],
                    }
                    data = b"data: " + json.dumps(event).encode() + b"\n\n"
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                options = request.get("stream_options")
                if isinstance(options, dict) and options.get("include_usage"):
                    # OpenAI's last chunk: no choices, the usage (as vLLM sends it when asked)
                    prompt = request.get("prompt") if not chat else request.get("messages")
                    prompt_tokens = len(json.dumps(prompt).split()) if prompt else 0
                    usage = {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": max_tokens,
                        "total_tokens": prompt_tokens + max_tokens,
                    }
                    event = {"id": rid, "object": chunk_obj, "created": created, "model": model}
                    data = json.dumps({**event, "choices": [], "usage": usage}).encode()
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b"data: " + data + b"\n\n",
                            "more_body": True,
                        }
                    )
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        state.request_done()


async def _serve_rendezvous(state: StubState) -> asyncio.Server:
    """Head side of the PP rendezvous: count followers, and die when one of them goes away."""
    settings = state.settings

    async def follower(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), HANDSHAKE_TIMEOUT_S)
            parts = line.decode(errors="replace").split()
            if len(parts) != 2 or parts[0] != "rank" or not parts[1].isdigit():
                writer.close()
                return
            rank = int(parts[1])
            state.followers.add(rank)
            writer.write(b"ok\n")
            await writer.drain()
            print(
                f"stub_server: follower rank {rank} joined "
                f"({len(state.followers)}/{settings.nnodes - 1})",
                file=sys.stderr,
                flush=True,
            )
        except (TimeoutError, OSError):
            writer.close()
            return
        with contextlib.suppress(OSError):
            while await reader.read(4096):
                pass
        _die(1, f"follower rank {rank} disconnected")

    try:
        return await asyncio.start_server(follower, host=None, port=settings.master_port)
    except OSError as exc:
        _die(1, f"cannot listen for followers on --master-port {settings.master_port}: {exc}")
        raise


async def _run_follower(settings: StubSettings, stop: asyncio.Event) -> int:
    """Follower side: connect to the head (retrying until the timeout), then live as long as it."""
    deadline = time.monotonic() + settings.distributed_timeout_seconds
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(settings.master_addr, settings.master_port),
                HANDSHAKE_TIMEOUT_S,
            )
            writer.write(f"rank {settings.node_rank}\n".encode())
            await writer.drain()
            if (await reader.readline()).strip() == b"ok":
                break
            writer.close()
        except (OSError, TimeoutError):
            pass
        if time.monotonic() >= deadline:
            _die(
                1,
                f"could not reach head {settings.master_addr}:{settings.master_port} within "
                f"--distributed-timeout-seconds={settings.distributed_timeout_seconds}",
            )
        if stop.is_set():
            return 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
        if stop.is_set():
            return 0
    print(f"stub_server: rank {settings.node_rank} joined the head", file=sys.stderr, flush=True)
    lost = asyncio.ensure_future(reader.read())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([lost, stopped], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        return 0
    _die(1, "connection to the head broke")
    return 1


def _install_stop(stop: asyncio.Event, on_stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()

    def handle() -> None:
        stop.set()
        on_stop()
        # SIGTERM contract: gone within 1 s whatever is still streaming.
        loop.call_later(0.8, _die, 0, "terminated")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle)


async def run(settings: StubSettings) -> int:
    """Run one stub lane (head or follower) until it is stopped or a knob ends it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    state = StubState(settings)
    if settings.exit_after and state.applies_exit_knobs:
        loop.call_later(
            settings.exit_after, _die, settings.exit_code, f"exit-after {settings.exit_after}s"
        )
    if settings.headless and settings.node_rank > 0:
        _install_stop(stop, lambda: None)
        return await _run_follower(settings, stop)

    from slurmgate.serving import quiet_server  # deferred: followers never pay for uvicorn

    rendezvous = await _serve_rendezvous(state) if settings.nnodes > 1 else None
    bootstrap = None
    if settings.disaggregation_mode == "prefill":
        try:
            bootstrap = await serve_bootstrap(
                state.rooms, settings.host, settings.bootstrap_port, settings.bootstrap_timeout
            )
        except OSError as exc:
            _die(
                1,
                f"cannot listen on --disaggregation-bootstrap-port {settings.bootstrap_port}: "
                f"{exc}",
            )
    server = quiet_server(StubApp(state), host=settings.host, port=settings.port, lifespan="off")

    def on_stop() -> None:
        server.should_exit = True

    async def close_listener() -> None:
        await state.listener_closed.wait()
        print(
            f"stub_server: closing the HTTP listener after {state.completed} requests; "
            "the process stays up until it is stopped",
            file=sys.stderr,
            flush=True,
        )
        server.should_exit = True

    closer = asyncio.ensure_future(close_listener())
    _install_stop(stop, on_stop)
    await server.serve()
    closer.cancel()
    if state.listener_closed.is_set() and not stop.is_set():
        await stop.wait()  # a live process without a listener: connects are refused
    if rendezvous is not None:
        rendezvous.close()
    if bootstrap is not None:
        bootstrap.close()
    if not server.started and not stop.is_set():
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    settings = parse_settings(argv)
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvicorn[standard] ships uvloop
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        code = runner.run(run(settings))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
