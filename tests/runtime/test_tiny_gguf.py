"""The tiny GGUF and the llama.cpp server launcher, on this machine (no Slurm).

A model hub is out of reach where the tests run, so the model is generated: `write_tiny_model`
writes a random-weight llama GGUF with its tokenizer, and the real llama.cpp server (xllamacpp's
wheel, started by `slurmgate.testbed.llamacpp_server`) loads and serves it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmgate.errors import InputError
from slurmgate.testbed.llamacpp_server import launch_command
from slurmgate.testbed.localproc import free_port, stop_group
from slurmgate.testbed.tiny_gguf import MODEL_NAME, write_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 100 000 extra tokens make llama.cpp's load last a few tenths of a second: long enough to
    # see /health answer 503 before 200.
    return write_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", extra_tokens=100_000)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, list[int]]]:
    """A running server on the tiny model, and every /health status seen until it was ready."""
    port = free_port()
    argv = [
        *launch_command(model, parallel=1, ctx_size=512, python=sys.executable),
        *["--host", "127.0.0.1", "--port", str(port), "--metrics", "-a", MODEL_NAME, "-lv", "1"],
    ]
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(trust_env=False, timeout=2) as client:
            while not statuses or statuses[-1] != 200:
                assert proc.poll() is None, f"the server exited with {proc.returncode}"
                assert time.monotonic() < deadline, f"not ready in 60 s: {statuses[-5:]}"
                with contextlib.suppress(httpx.TransportError):  # not listening yet
                    statuses.append(client.get(url + "/health").status_code)
                time.sleep(0.01)
        yield proc, url, statuses
    finally:
        stop_group(proc)


def test_health_answers_503_while_the_model_loads_then_200(
    server: tuple[subprocess.Popen[bytes], str, list[int]],
) -> None:
    _, _, statuses = server
    assert statuses[-1] == 200
    assert 503 in statuses, statuses  # llama.cpp listens before the model is loaded
    assert set(statuses) == {503, 200}, statuses
    first_ok = statuses.index(200)
    assert all(s == 503 for s in statuses[:first_ok])


def test_models_completion_and_metrics(
    server: tuple[subprocess.Popen[bytes], str, list[int]],
) -> None:
    _, url, _ = server
    with httpx.Client(trust_env=False, timeout=30) as client:
        models = client.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        r = client.post(
            url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 24},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        # The model never emits EOS, so it always generates exactly max_tokens, all printable.
        assert body["usage"]["completion_tokens"] == 24
        text = body["choices"][0]["text"]
        assert text and text.isprintable(), text
        metrics = client.get(url + "/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    # the names the llamacpp engine profile samples for backpressure
    assert values["llamacpp:requests_deferred"] == 0
    assert values["llamacpp:requests_processing"] == 0
    assert values["llamacpp:tokens_predicted_total"] >= 24


def test_chat_completion_streams_sse(
    server: tuple[subprocess.Popen[bytes], str, list[int]],
) -> None:
    _, url, _ = server
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
        "stream": True,
    }
    events: list[str] = []
    with (
        httpx.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", url + "/v1/chat/completions", json=request) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content and content.isprintable()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_sigterm_stops_the_server_and_exits_0(model: Path) -> None:
    port = free_port()
    argv = [*launch_command(model, python=sys.executable), "--port", str(port), "-lv", "1"]
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
    try:
        with httpx.Client(trust_env=False, timeout=2) as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False)
    finally:
        stop_group(proc)


def test_a_missing_model_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    done = subprocess.run(
        [*launch_command(missing, python=sys.executable), "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"--model {missing}: no such file" in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_head_shape_names_the_fields(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="n_head_kv"):
        write_tiny_model(tmp_path / "m.gguf", n_embd=64, n_head=4, n_head_kv=3)
    assert not (tmp_path / "m.gguf").exists()


def test_the_command_writes_a_llama_gguf_with_its_tokenizer(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = tmp_path / "cli.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "slurmgate.testbed.tiny_gguf", str(path), "--extra-tokens", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert str(path) in done.stdout
    reader = GGUFReader(path)
    fields = reader.fields

    def text(key: str) -> str:
        field = fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    assert text("general.architecture") == "llama"
    assert text("tokenizer.ggml.model") == "llama"
    assert "tokenizer.chat_template" in fields
    # <unk> <s> </s>, 256 bytes, "▁", 94 printable characters, 52 "▁"-letters, 10 extra words
    assert len(fields["tokenizer.ggml.tokens"].data) == 3 + 256 + 1 + 94 + 52 + 10
    assert {t.name for t in reader.tensors} >= {"token_embd.weight", "output.weight"}
