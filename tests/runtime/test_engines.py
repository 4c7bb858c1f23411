"""Engine profiles: each engine's launch flags, readiness and queue metric (no Slurm).

The flag and metric names are pinned against the engines' own documentation and source:
- vLLM: https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html (multi-node without
  Ray: --nnodes, --node-rank, --master-addr, --master-port, --headless on followers) and
  https://github.com/vllm-project/vllm/blob/main/vllm/v1/metrics/loggers.py
  (vllm:num_requests_waiting, vllm:num_requests_running);
- SGLang: https://docs.sglang.ai/advanced_features/server_arguments.html (--tp-size, --pp-size,
  --nnodes, --node-rank, --dist-init-addr, --dist-timeout) and
  https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/metrics/collector.py
  (sglang:num_queue_reqs, sglang:num_running_reqs);
- llama.cpp: https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md (/health
  answers 503 while the model loads; --metrics enables /metrics with
  llamacpp:requests_deferred and llamacpp:requests_processing).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from slurmgate.runtime.endpoint.backpressure import metrics_query, queue_sample
from slurmgate.runtime.endpoint.config import EndpointConfig, parse_config
from slurmgate.runtime.engines import layout
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.steps import readiness


def _spec(engine: str = "custom", **dep: Any) -> AllocationSpec:
    d: dict[str, Any] = {
        "name": "g",
        "engine": engine,
        "command": ["serve-it", "m"],
        "tensor_parallel": 4,
        "pipeline_parallel": 2,
        "nodes_per_replica": 2,
        "replicas": 2,
    }
    d.update(dep)
    return AllocationSpec.from_data(
        {"name": "golden", "client": {"command": ["true"]}, "deployments": [d]}
    )


def _argvs(spec: AllocationSpec) -> list[list[str]]:
    p = layout.plan(spec)
    lay = layout.bind(p, [f"n{i}" for i in range(p.total_nodes)])
    out = []
    for n in p.deployments[0].nodes:
        for lane in n.lanes:
            master = lay.address(lane.rendezvous_node)
            out.append(
                layout.lane_argv(spec.deployments[0], lane, master, bind_host=lay.address(n.node))
            )
    return out


def test_custom_renders_todays_vllm_style_argv_byte_for_byte() -> None:
    # The stub server parses these flags: `custom` (the default) must not change them.
    head0, _, _, follower1 = _argvs(_spec())
    assert head0 == [
        "serve-it", "m", "--host", "n0", "--port", "18000",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "n0", "--master-port", "19000",
        "--distributed-timeout-seconds", "600",
    ]  # fmt: skip
    assert follower1 == [
        "serve-it", "m",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "n0", "--master-port", "19001",
        "--distributed-timeout-seconds", "600", "--headless",
    ]  # fmt: skip
    assert _argvs(_spec("vllm", command=["vllm", "serve", "m"]))[0][3:] == head0[2:]
    one_node = _argvs(_spec(pipeline_parallel=1, nodes_per_replica=1, replicas=1))
    assert one_node == [
        ["serve-it", "m", "--host", "n0", "--port", "18000",
         "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1"],
    ]  # fmt: skip


def test_sglang_renders_its_own_multi_node_flags() -> None:
    spec = _spec("sglang", command=["python", "-m", "sglang.launch_server"])
    head, head1, follower, _ = _argvs(spec)
    # SGLang's sockets follow the --dist-init-addr port (+1 … +6): the next lane starts past them
    assert head1[head1.index("--dist-init-addr") + 1] == "n0:19007"
    assert layout.plan(spec).deployments[0].nodes[0].ports == (18000, 18001, *range(19000, 19014))
    assert head == [
        "python", "-m", "sglang.launch_server", "--host", "n0", "--port", "18000",
        "--tp-size", "4", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "n0:19000",
        "--dist-timeout", "600", "--enable-metrics",
    ]  # fmt: skip
    # a follower has no HTTP server and no --headless: SGLang's ranks > 0 never serve HTTP
    assert follower[3:] == [
        "--tp-size", "4", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "n0:19000",
        "--dist-timeout", "600", "--enable-metrics",
    ]  # fmt: skip


def test_llamacpp_is_one_node_with_metrics_on() -> None:
    spec = _spec(
        "llamacpp",
        command=["llama-server", "-m", "/models/tiny.gguf"],
        tensor_parallel=1,
        pipeline_parallel=1,
        nodes_per_replica=1,
        gpus_per_node=2,
    )
    assert _argvs(spec) == [
        ["llama-server", "-m", "/models/tiny.gguf", "--host", "n0", "--port", "18000", "--metrics"],
        ["llama-server", "-m", "/models/tiny.gguf", "--host", "n0", "--port", "18001", "--metrics"],
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({}, "deployments[0].nodes_per_replica", "runs a replica on one node only"),
        (
            {"pipeline_parallel": 1, "nodes_per_replica": 1, "enable_expert_parallel": True},
            "deployments[0].enable_expert_parallel",
            "no expert-parallel flag",
        ),
        (
            {
                "pipeline_parallel": 1,
                "nodes_per_replica": 1,
                "command": ["llama-server", "--metrics"],
            },
            "deployments[0].command",
            "--metrics is set by the launcher",
        ),
    ],
)
def test_llamacpp_refuses_what_it_cannot_run_naming_the_field(
    change: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(SpecError) as err:
        _spec("llamacpp", **{"command": ["llama-server"], **change})
    (where, message, fix), *_ = err.value.problems
    assert where == field and words in message and fix


@pytest.mark.parametrize(
    ("engine", "flag"),
    [
        ("vllm", "-tp"),
        ("vllm", "--data-parallel-address=10.0.0.1"),
        ("sglang", "--tp"),
        ("sglang", "--dist-init-addr=10.0.0.1:5000"),
        ("sglang", "--nnodes"),
        ("llamacpp", "--port"),
    ],
)
def test_each_engine_keeps_its_launcher_flags_out_of_the_command(engine: str, flag: str) -> None:
    with pytest.raises(SpecError) as err:
        _spec(engine, command=["server", flag, "2"], pipeline_parallel=1, nodes_per_replica=1)
    (where, message, _fix), *_ = err.value.problems
    assert where == "deployments[0].command" and flag.split("=")[0] in message


def test_custom_still_accepts_what_only_other_engines_own() -> None:
    # `--tp` means nothing to the launcher of a custom server: refusing it would break specs.
    spec = _spec(command=["server", "--tp", "2", "--metrics"])
    assert spec.deployments[0].command[1:] == ["--tp", "2", "--metrics"]


def test_the_model_path_and_served_name_come_from_the_engines_own_flags() -> None:
    vllm, sglang, llama = engines.VLLM, engines.SGLANG, engines.LLAMACPP
    assert vllm.model_path(["vllm", "serve", "/models/m", "--dtype", "auto"]) == "/models/m"
    assert vllm.model_path(["vllm", "serve", "org/model"]) is None  # a hub id, not a path
    assert vllm.model_path(["python", "-m", "x", "--model=/m"]) == "/m"
    assert sglang.model_path(["python", "-m", "sglang.launch_server", "--model-path", "/m"]) == "/m"
    assert llama.model_path(["llama-server", "-m", "/m.gguf"]) == "/m.gguf"
    # the interpreter's own -m names a module, not the model
    assert llama.model_path(["python", "-m", "pkg.server", "-m", "/m.gguf"]) == "/m.gguf"
    assert engines.CUSTOM.model_path(["stub", "--model", "/m"]) is None  # custom: as before
    assert vllm.served_model(["vllm", "serve", "/m", "--served-model-name", "chat"]) == "chat"
    assert vllm.models_probe(["vllm", "serve", "/m"]) == (True, "")
    assert sglang.models_probe(["s", "--served-model-name=chat"]) == (True, "chat")
    assert engines.CUSTOM.models_probe(["stub"]) == (True, None)
    assert llama.models_probe(["llama-server"]) == (False, None)


def test_queue_samples_read_each_engines_gauges() -> None:
    sglang_page = (
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 3.0\n'
        'sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="1"} 2.0\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 8.0\n'
        'vllm:num_requests_waiting{model_name="m"} 99\n'
    )
    q = engines.SGLANG.queue
    assert queue_sample(sglang_page, q.waiting, q.running) == (5.0, 8.0)
    llama_page = (
        "# HELP llamacpp:requests_processing Number of requests processing.\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 1\n"
        "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
        "# TYPE llamacpp:requests_deferred gauge\n"
        "llamacpp:requests_deferred 4\n"
    )
    q = engines.LLAMACPP.queue
    assert queue_sample(llama_page, q.waiting, q.running) == (4.0, 1.0)
    assert queue_sample(llama_page) == (None, None)  # vLLM's names are not on this page
    assert "llamacpp:requests_deferred" in metrics_query(q.waiting, q.running)


def test_the_endpoint_carries_the_metric_names_as_flags_and_defaults_are_unchanged() -> None:
    base = EndpointConfig(name="d", backends=["http://127.0.0.1:1"])
    assert base.argv() == ["--name", "d", "--listen", "127.0.0.1:0", "--backend", base.backends[0]]
    q = engines.SGLANG.queue
    cfg = base.model_copy(
        update={"queue_waiting_metric": q.waiting, "queue_running_metric": q.running}
    )
    argv = cfg.argv()
    assert argv[-4:] == [
        "--queue-waiting-metric", "sglang:num_queue_reqs",
        "--queue-running-metric", "sglang:num_running_reqs",
    ]  # fmt: skip
    assert parse_config(argv, environ={}) == cfg
    with pytest.raises(SystemExit):
        parse_config([*argv, "--queue-waiting-metric", "not a name"], environ={})


class _Models:
    """A server whose /health is 200 and whose /v1/models lists `served` after `after` calls."""

    def __init__(self, served: list[str], after: int) -> None:
        self.calls = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b""
                if self.path == "/v1/models":
                    owner.calls += 1
                    listed = served if owner.calls > after else []
                    body = json.dumps({"object": "list", "data": [{"id": m} for m in listed]})
                    body = body.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def models_server() -> Iterator[type[_Models]]:
    made: list[_Models] = []

    def make(served: list[str], after: int) -> _Models:
        made.append(_Models(served, after))
        return made[-1]

    yield make  # type: ignore[misc]
    for s in made:
        s.server.shutdown()
        s.server.server_close()


def test_vllm_readiness_waits_until_the_served_model_is_listed(models_server: Any) -> None:
    server = models_server(["chat"], after=3)
    models, lists = engines.VLLM.models_probe(
        ["vllm", "serve", "/m", "--served-model-name", "chat"]
    )
    target = readiness.Target(
        name="lane",
        base_url=server.url,
        deadline=time.monotonic() + 10,
        models=models,
        lists_model=lists,
    )
    readiness.wait_ready([target], poll_s=0.01)
    # three answers of 200 with an empty list did not count: /health alone is not ready
    assert server.calls == 4 and target.ready

    other = models_server(["base"], after=0)
    late = readiness.Target(
        name="lane", base_url=other.url, deadline=time.monotonic() + 0.3, lists_model="chat"
    )
    with pytest.raises(readiness.ReadinessTimeout, match="does not list 'chat' yet"):
        readiness.wait_ready([late], poll_s=0.05)
    # custom: /v1/models answering 200 is enough, as before
    custom = readiness.Target(name="lane", base_url=other.url, deadline=time.monotonic() + 5)
    readiness.wait_ready([custom], poll_s=0.01)
