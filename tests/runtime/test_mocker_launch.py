"""The mocker and frontend launches: what the renderer says, and what Dynamo's own parsers read.

The renderer is pure; the last tests hand its argv and env to Dynamo 1.6.1's own argument
parsers (`dynamo.mocker.args.parse_args`, the frontend's `FrontendArgGroup` and
`FrontendConfig`) in the `.venv-dynamo` venv, so a flag or variable Dynamo does not know fails
here. The processes themselves run in test_dynamo_mocker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from slurmgate.errors import InputError
from slurmgate.runtime.engines import mocker
from slurmgate.runtime.engines.mocker import (
    EtcdDiscovery,
    FileDiscovery,
    MockerOptions,
    ZmqBroker,
    dynamo_env,
    frontend_launch,
    mocker_launch,
)

REPO = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
HOST_VARS = (
    "DYN_TCP_RPC_HOST",
    "DYN_TCP_RESPONSE_STREAM_HOST",
    "DYN_SYSTEM_HOST",
    "DYN_EVENT_PLANE_HOST",
)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "::1"])
def test_every_listener_variable_names_the_bind_host(host: str) -> None:
    env = dynamo_env(host, FileDiscovery("/d"))
    assert {v: env[v] for v in HOST_VARS} == dict.fromkeys(HOST_VARS, host)
    assert env["DYN_REQUEST_PLANE"] == "tcp"
    assert env["DYN_EVENT_PLANE"] == "zmq"


def test_file_and_etcd_discovery_set_their_own_variables_only() -> None:
    files = dynamo_env("127.0.0.1", FileDiscovery("/run/kv"))
    assert files["DYN_DISCOVERY_BACKEND"] == "file"
    assert files["DYN_FILE_KV"] == "/run/kv"
    assert "ETCD_ENDPOINTS" not in files
    etcd = dynamo_env("127.0.0.1", EtcdDiscovery(("http://10.0.0.1:2379", "http://10.0.0.2:2379")))
    assert etcd["DYN_DISCOVERY_BACKEND"] == "etcd"
    assert etcd["ETCD_ENDPOINTS"] == "http://10.0.0.1:2379,http://10.0.0.2:2379"
    assert "DYN_FILE_KV" not in etcd


def test_a_broker_puts_the_event_plane_in_broker_mode() -> None:
    broker = ZmqBroker("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556")
    env = dynamo_env("127.0.0.1", FileDiscovery("/d"), broker=broker)
    assert env["DYN_ZMQ_BROKER_URL"] == "xsub=tcp://127.0.0.1:5555,xpub=tcp://127.0.0.1:5556"
    assert "DYN_ZMQ_BROKER_URL" not in dynamo_env("127.0.0.1", FileDiscovery("/d"))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "node1", ""])
def test_a_bind_host_that_cannot_be_advertised_is_refused(host: str) -> None:
    with pytest.raises(InputError, match="bind_host"):
        dynamo_env(host, FileDiscovery("/d"))


def test_empty_discovery_is_refused() -> None:
    with pytest.raises(InputError, match="DYN_FILE_KV"):
        dynamo_env("127.0.0.1", FileDiscovery(""))
    with pytest.raises(InputError, match="endpoint"):
        dynamo_env("127.0.0.1", EtcdDiscovery(()))


def test_the_mocker_gets_its_role_ports_and_only_the_options_set() -> None:
    launch = mocker_launch(
        "decode",
        "/models/tiny",
        "tiny",
        8101,
        "127.0.0.1",
        FileDiscovery("/d"),
        python="/venv/bin/python",
        rpc_port=8102,
        options=MockerOptions(speedup_ratio=0.5, max_num_seqs=4),
    )
    argv = list(launch.argv)
    assert argv[:3] == ["/venv/bin/python", "-m", "dynamo.mocker"]
    assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
    assert argv[argv.index("--model-path") + 1] == "/models/tiny"
    assert argv[argv.index("--model-name") + 1] == "tiny"
    assert argv[argv.index("--speedup-ratio") + 1] == "0.5"
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    for unset in ("--block-size", "--startup-time", "--num-gpu-blocks-override"):
        assert unset not in argv
    assert launch.env["DYN_SYSTEM_PORT"] == "8101"
    assert launch.env["DYN_TCP_RPC_PORT"] == "8102"
    assert json.loads(launch.env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"]) == ["generate"]
    plain = mocker_launch("prefill", "/m", "tiny", 8101, "127.0.0.1", FileDiscovery("/d"))
    assert "DYN_TCP_RPC_PORT" not in plain.env


def test_the_frontend_gets_its_address_response_port_and_migration_limit() -> None:
    launch = frontend_launch(
        8000, "10.0.0.5", EtcdDiscovery(("http://10.0.0.1:2379",)), response_port=8001
    )
    argv = list(launch.argv)
    assert argv[:3] == ["python3", "-m", "dynamo.frontend"]
    assert argv[argv.index("--http-host") + 1] == "10.0.0.5"
    assert argv[argv.index("--http-port") + 1] == "8000"
    assert "--migration-limit" not in argv
    assert launch.env["DYN_TCP_RESPONSE_STREAM_PORT"] == "8001"
    assert launch.env["DYN_TCP_RESPONSE_STREAM_HOST"] == "10.0.0.5"
    migrating = frontend_launch(8000, "10.0.0.5", FileDiscovery("/d"), migration_limit=3)
    assert migrating.argv[-2:] == ("--migration-limit", "3")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: mocker_launch("router", "/m", "t", 8101, "127.0.0.1", FileDiscovery("/d")),
            "role",
        ),  # type: ignore[arg-type]
        (lambda: mocker_launch("agg", "/m", "t", 0, "127.0.0.1", FileDiscovery("/d")), "port"),
        # Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16: 32768 would stop the worker at start
        (
            lambda: mocker_launch("agg", "/m", "t", 32768, "127.0.0.1", FileDiscovery("/d")),
            "between 1 and 32767",
        ),
        (lambda: frontend_launch(70000, "127.0.0.1", FileDiscovery("/d")), "port"),
        (
            lambda: frontend_launch(8000, "127.0.0.1", FileDiscovery("/d"), migration_limit=-1),
            "migration_limit",
        ),
    ],
)
def test_bad_launch_values_are_refused(make: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        make()  # type: ignore[operator]


PARSE = """
import argparse, json, sys
from dynamo.mocker.args import parse_args
from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig
which, argv = json.load(sys.stdin)
if which == "mocker":
    a = parse_args(argv)
    keys = ("model_path", "model_name", "disaggregation_mode", "speedup_ratio", "max_num_seqs",
            "num_gpu_blocks", "block_size", "startup_time", "dp_size", "discovery_backend",
            "request_plane", "event_plane")
    print(json.dumps({k: getattr(a, k) for k in keys}))
else:
    parser = argparse.ArgumentParser()
    FrontendArgGroup().add_arguments(parser)
    a, unknown = parser.parse_known_args(argv)
    c = FrontendConfig.from_cli_args(a)
    c.validate()
    keys = ("http_host", "http_port", "migration_limit", "discovery_backend", "request_plane",
            "event_plane")
    print(json.dumps({"unknown": unknown, **{k: getattr(c, k) for k in keys}}))
"""


def _dynamo_parse(which: str, argv: tuple[str, ...], env: dict[str, str]) -> dict[str, object]:
    if not DYNAMO_PYTHON.exists():
        pytest.skip(
            "Dynamo is not installed: SLURMGATE_WITH_DYNAMO=1 scripts/setup.sh makes "
            ".venv-dynamo (scripts/test.sh does)"
        )
    done = subprocess.run(
        [str(DYNAMO_PYTHON), "-c", PARSE],
        input=json.dumps([which, list(argv[3:])]),  # past "python -m module"
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return parsed


def test_dynamos_own_parsers_read_the_mocker_launch(tmp_path: Path) -> None:
    options = MockerOptions(
        max_num_seqs=3,
        speedup_ratio=2.5,
        num_gpu_blocks=512,
        block_size=16,
        startup_time=0.5,
        data_parallel_size=2,
    )
    launch = mocker_launch(
        "prefill", str(tmp_path), "tiny", 8101, "127.0.0.1", FileDiscovery("/d"), options=options
    )
    parsed = _dynamo_parse("mocker", launch.argv, dict(launch.env))
    assert parsed == {
        "model_path": str(tmp_path),
        "model_name": "tiny",
        "disaggregation_mode": "prefill",
        "speedup_ratio": 2.5,
        "max_num_seqs": 3,
        "num_gpu_blocks": 512,
        "block_size": 16,
        "startup_time": 0.5,
        "dp_size": 2,
        "discovery_backend": "file",
        "request_plane": "tcp",
        "event_plane": "zmq",
    }


def test_dynamos_own_parser_reads_the_frontend_launch() -> None:
    launch = frontend_launch(
        8000, "127.0.0.1", EtcdDiscovery(("http://127.0.0.1:2379",)), migration_limit=2
    )
    parsed = _dynamo_parse("frontend", launch.argv, dict(launch.env))
    assert parsed == {
        "unknown": [],
        "http_host": "127.0.0.1",
        "http_port": 8000,
        "migration_limit": 2,
        "discovery_backend": "etcd",
        "request_plane": "tcp",
        "event_plane": "zmq",
    }


def test_served_requests_sums_the_generate_endpoints_series() -> None:
    text = "\n".join(
        [
            "# TYPE dynamo_component_requests_total counter",
            'dynamo_component_requests_total{dynamo_component="backend",'
            'dynamo_endpoint="generate",worker_id="1"} 4',
            'dynamo_component_requests_total{dynamo_component="backend",'
            'dynamo_endpoint="clear_kv_blocks",worker_id="1"} 9',
            'dynamo_component_requests_total{dynamo_component="backend",'
            'dynamo_endpoint="generate",worker_id="2"} 1',
        ]
    )
    assert mocker.served_requests(text) == 5
    assert mocker.served_requests("dynamo_component_uptime_seconds 3") is None
