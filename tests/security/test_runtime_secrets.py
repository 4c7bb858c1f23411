"""Credentials in the allocation runtime: what reaches a step, what never reaches argv or a copy.

The cluster tests read the real processes' /proc/<pid>/environ and cmdline while a run is up on
the bundled Slurm cluster; the others check the spec's references, the redactor and the
step environment's allow-list on their own.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from slurmgate.runtime.redact import Redactor
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.credentials import RunCredentials, SecretUnresolved
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.stepenv import step_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "specs" / "local-stub.yaml"


def example_data() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return data


def _value(label: str) -> str:
    return f"{label}-{secrets.token_hex(8)}"


# -- the spec holds references, never values ------------------------------------------------


def test_a_plain_credential_value_in_the_spec_is_refused_with_the_fix() -> None:
    data = example_data()
    data["deployments"][0]["env"] = {"HF_TOKEN": "hf_plainvalue"}
    with pytest.raises(SpecError) as caught:
        AllocationSpec.from_data(data)
    message = str(caught.value)
    assert "deployments[0].env" in message and "HF_TOKEN" in message
    assert "{secret: BLOCK-NAME}" in message and "hf_plainvalue" not in message


@pytest.mark.parametrize(
    "tail",
    [
        ["--api-key", "sk-lane-literal"],
        ["--api-key=sk-lane-literal"],
        ["--hf-token", "hf_lanevalue"],
        ["--admin-api-key", "k-lane-literal"],
    ],
)
def test_a_credential_in_a_lane_command_is_refused_with_the_fix(tail: list[str]) -> None:
    """The command is part of the spec, a flow-run parameter, and of every node's argv."""
    data = example_data()
    data["deployments"][0]["command"] = [*data["deployments"][0]["command"], *tail]
    with pytest.raises(SpecError) as caught:
        AllocationSpec.from_data(data)
    field, message, fix = caught.value.problems[0]
    assert field == "deployments[0].command", caught.value
    assert "carries a credential" in message and "VLLM_API_KEY" in fix
    assert "endpoint_token" in fix
    assert "literal" not in str(caught.value) and "lanevalue" not in str(caught.value)


def test_a_bare_credential_flag_and_token_sized_flags_are_kept() -> None:
    """vLLM's bare --hf-token means "the cached login"; --max-num-batched-tokens is a size."""
    data = example_data()
    base = data["deployments"][0]["command"]
    data["deployments"][0]["command"] = [
        *base,
        "--hf-token",
        "--max-num-batched-tokens",
        "8192",
        "--tokenizer",
        "/models/tok",
    ]
    spec = AllocationSpec.from_data(data)
    assert spec.deployments[0].command[-5:] == data["deployments"][0]["command"][-5:]


def test_the_spec_stores_only_references_and_a_secretstr_is_masked() -> None:
    value = _value("inline")
    data = example_data()
    data["deployments"][0]["env"] = {"HF_TOKEN": {"secret": "hf-token"}}
    data["client"]["env"] = {"API_KEY": SecretStr(value)}
    data["endpoint_token"] = {"from_env": "SG_ENDPOINT_TOKEN"}
    spec = AllocationSpec.from_data(data)
    stored = json.dumps(spec.model_dump(mode="json"))
    assert value not in stored
    assert '{"secret": "hf-token"}' in stored and '{"from_env": "SG_ENDPOINT_TOKEN"}' in stored
    assert spec.secret_references() == [
        "client.env.API_KEY: a SecretStr value",
        "deployments[0].env.HF_TOKEN: Secret block 'hf-token'",
        "endpoint_token: controller variable SG_ENDPOINT_TOKEN",
    ]


def test_references_resolve_on_this_host_or_fail_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = example_data()
    data["deployments"][1]["env"] = {"HF_TOKEN": {"secret": "hf-token"}}
    data["endpoint_token"] = {"from_env": "SG_TEST_MISSING"}
    spec = AllocationSpec.from_data(data)
    monkeypatch.delenv("SG_TEST_MISSING", raising=False)
    with pytest.raises(SecretUnresolved, match=r"endpoint_token: .*SG_TEST_MISSING"):
        RunCredentials.resolve(spec, {"hf-token": "x" * 8}.__getitem__)
    monkeypatch.setenv("SG_TEST_MISSING", "endpoint-token-value")
    with pytest.raises(SecretUnresolved, match=r"deployments\[1\]\.env\.HF_TOKEN: .*needs Prefect"):
        RunCredentials.resolve(spec, None)
    with pytest.raises(SecretUnresolved, match="cannot read Secret block 'hf-token'") as caught:
        RunCredentials.resolve(spec, {}.__getitem__)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    creds = RunCredentials.resolve(spec, {"hf-token": "hf-value-1"}.__getitem__)
    assert creds.deployment_env[1] == {"HF_TOKEN": "hf-value-1"}
    assert creds.endpoint_token == "endpoint-token-value"
    assert creds.secret_values == {"hf-value-1", "endpoint-token-value"}


# -- the redactor ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("vllm serve m --api-key abc123def --port 1", "--port 1"),
        ("INFO non-default args: {'model': 'm', 'api_key': ['abc123def'], 'port': 8}", "'port': 8"),
        ("GET / headers: Authorization: Bearer abc123def", "Authorization: Bearer"),
        ("PASSWORD=abc123def and more", "and more"),
        ("cloning with ghp_abc123defabc123defabc123def0", "cloning with"),
        ("token github_pat_11AAAAAAA0abc123def_abc123defabc123def", "token"),
        ("HF hub: hf_abc123defabc123defabc123def", "HF hub"),
        ("openai key sk-proj-abc123defabc123defabc123def", "openai key"),
    ],
)
def test_known_credential_patterns_are_masked(text: str, kept: str) -> None:
    out = Redactor()(text)
    assert "abc123def" not in out and "***" in out and kept in out


def test_the_runs_own_values_are_masked_and_ordinary_words_are_not() -> None:
    redact = Redactor(["s3cr3t-value", "ab"])  # too short to mask safely
    out = redact("value s3cr3t-value, max_tokens=4 SLURMGATE_STUB_TOKENS_PER_SECOND=2000 ab")
    assert out == "value ***, max_tokens=4 SLURMGATE_STUB_TOKENS_PER_SECOND=2000 ab"


def test_benchmark_numbers_under_token_named_keys_are_kept() -> None:
    """A benchmark's result files are collected through the redactor: a key that ends in a
    credential word but holds a mapping, a list or a number is data, not a credential."""
    text = (
        '{"time_to_first_token": {"avg": 37.9},\n "output_tokens": 25, "max_tokens=512",\n'
        ' "itl_tokens": [1, 2], "api_key": "abc123def"}'
    )
    out = Redactor()(text)
    assert out == text.replace('"abc123def"', "***")


# -- the step environment's allow-list ----------------------------------------------------------


def test_step_env_keeps_what_steps_need_and_drops_controller_credentials() -> None:
    controller = {
        "PATH": "/usr/bin",
        "HOME": "/home/ci",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_JOB_ID": "41",
        "SLURM_STEP_GPUS": "0,1",
        "CUDA_HOME": "/usr/local/cuda",
        "NCCL_DEBUG": "INFO",
        "HF_HOME": "/scratch/hf",
        "HF_TOKEN": "hf-from-controller",
        "PREFECT_API_AUTH_STRING": "admin:pass",
        "PREFECT_API_KEY": "pnu_x",
        "PREFECT_API_URL": "http://prefect:4200/api",
        "GITHUB_TOKEN": "ghs_x",
        "FOO_TOKEN": "foo",
        "AWS_SECRET_ACCESS_KEY": "aws",
        "DB_SECRET": "db",
        "VLLM_API_KEY": "vk",
        "RANDOM_APP_SETTING": "x",
    }
    env = step_env(controller, {"HF_TOKEN": "named-by-the-spec"})
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/ci",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "CUDA_HOME": "/usr/local/cuda",
        "NCCL_DEBUG": "INFO",
        "HF_HOME": "/scratch/hf",
        "HF_TOKEN": "named-by-the-spec",
    }


# -- on the real cluster ----------------------------------------------------------------------


def _processes() -> Iterator[tuple[int, bytes, bytes]]:
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:
            continue
        yield int(entry.name), cmdline, environ


def _environ(raw: bytes) -> dict[str, str]:
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


# The client: dump its environment, prove the endpoint wants the token (but not on /health),
# then print credentials the way a careless server would and fail, so the run copies its tail.
CLIENT = r"""
import json, os, sys, urllib.error, urllib.request
json.dump(dict(os.environ), open(os.environ["SG_TEST_ENV_DUMP"], "w"))
url = os.environ["SLURMGATE_ENDPOINT_CHAT"]
body = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 2}).encode()
def status(path, token=None, data=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    try:
        request = urllib.request.Request(url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
token = os.environ["SLURMGATE_ENDPOINT_TOKEN"]
codes = [status("/health"), status("/v1/completions", None, body),
         status("/v1/completions", "wrong", body), status("/v1/completions", token, body)]
hf, other = os.environ["HF_TOKEN"], os.environ["CLIENT_SECRET"]
# one write per line: the step runs unbuffered, and srun's own lines may come in between
sys.stdout.write(f"auth {' '.join(map(str, codes))}\n")
# built at run time: the spec's guard refuses a literal credential flag or header
flag, header = "--api" + "-key", "Authori" + "zation: Bearer"
sys.stdout.write(f"serving with {flag} {hf} and {header} {token}\n")
sys.stdout.write(f"leaked {hf} {token} {other} ghp_{'a' * 36}\n")
sys.stdout.flush()
sys.exit(3)
"""


@pytest.fixture
def _cluster(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def test_controller_credentials_stay_behind_and_spec_secrets_reach_only_their_steps(
    _cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = {
        "PREFECT_API_AUTH_STRING": _value("prefect-auth"),
        "GITHUB_TOKEN": _value("github-token"),
        "FOO_TOKEN": _value("foo-token"),
        "DEPLOY_SECRET": _value("deploy-secret"),
    }
    hf, endpoint_token, client_secret = _value("hf"), _value("endpoint"), _value("client")
    for key, value in controller.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SG_TEST_ENDPOINT_TOKEN", endpoint_token)
    data = example_data()
    data["deployments"][0]["env"]["HF_TOKEN"] = {"secret": "hf-token"}
    # a script file, as a site ships one: its text handles credentials by name
    (tmp_path / "client.py").write_text(CLIENT)
    data["client"]["command"] = [sys.executable, str(tmp_path / "client.py")]
    data["client"]["env"] = {
        "SG_TEST_ENV_DUMP": str(tmp_path / "client-env.json"),
        "HF_TOKEN": {"secret": "hf-token"},
        "CLIENT_SECRET": SecretStr(client_secret),
    }
    data["endpoint_token"] = {"from_env": "SG_TEST_ENDPOINT_TOKEN"}
    spec = AllocationSpec.from_data(data)
    logs: list[str] = []
    run = AllocationRun(
        spec,
        runs_root=tmp_path / "runs",
        grace_s=5,
        log=logs.append,
        resolve_secret={"hf-token": hf}.__getitem__,
    )
    spec_secrets = [hf, endpoint_token, client_secret]
    failure: BaseException | None = None
    try:
        run.until_ready()
        run.start_endpoints()
        seen = {"chat": 0, "pipe": 0, "endpoint": 0, "worker": 0}
        for pid, cmdline, raw in _processes():
            env = _environ(raw)
            if env.get("SLURMGATE_RUN_ID") != run.run_id:
                continue
            for secret in [*controller.values(), *spec_secrets]:
                assert secret.encode() not in cmdline, (pid, cmdline)
            assert not set(controller) & set(env), (pid, cmdline, sorted(env))
            lane = env.get("SLURMGATE_RUN_LANE", "")
            if lane.startswith("chat"):
                seen["chat"] += 1
                assert env["HF_TOKEN"] == hf  # named by the spec: it reaches its lanes
            elif lane.startswith("pipe"):
                seen["pipe"] += 1
                assert "HF_TOKEN" not in env  # another deployment's secret does not
            elif b"slurmgate.runtime.endpoint" in cmdline:
                seen["endpoint"] += 1
                assert env["SLURMGATE_ENDPOINT_TOKEN"] == endpoint_token
                assert hf not in raw.decode(errors="replace")
            elif b"slurmgate.runtime.steps.node_worker" in cmdline:
                seen["worker"] += 1
                assert b"--spec\0-" in cmdline  # its spec came on stdin
        assert seen["chat"] == 2 and seen["pipe"] == 2 and seen["endpoint"] >= 2, seen
        assert seen["worker"] >= 3, seen
        with pytest.raises(RunFailed) as caught:
            run.run_client()
        failure = caught.value
    finally:
        run.finish(failure)
    client_env = json.loads((tmp_path / "client-env.json").read_text())
    assert not set(controller) & set(client_env), sorted(client_env)
    assert client_env["HF_TOKEN"] == hf and client_env["CLIENT_SECRET"] == client_secret
    assert client_env["SLURMGATE_ENDPOINT_TOKEN"] == endpoint_token
    client_log = next((tmp_path / "runs" / run.run_id).glob("[0-9][0-9]-client.log")).read_text()
    # /health answers without the token; the API needs exactly this one
    assert "auth 200 401 401 200" in client_log, client_log
    assert hf in client_log  # the raw log (0600, in a 0700 directory) is the step's own
    # Every copy of the failing step's tail is redacted: the error, the record, the logs.
    message = str(failure)
    assert "leaked" in message and "***" in message, message
    record_text = run.record_path.read_text()
    copies = {"error": message, "record": record_text, "logs": "\n".join(logs)}
    for where, text in copies.items():
        for secret in [*controller.values(), *spec_secrets, "ghp_" + "a" * 36]:
            assert secret not in text, (where, text)
    assert "--api-key ***" in message and "Authorization: Bearer ***" in message


# The client of the flow test: show the secret the way a careless server would, then fail.
LEAKY_CLIENT = (
    "import os, sys; t = os.environ['HF_TOKEN']; "
    "f = '--api' + '-key'; sys.stdout.write(f'serving {f} {t} raw {t}\\n'); sys.stdout.flush(); "
    "sys.exit(2)"
)


def test_through_prefect_only_the_reference_is_stored_and_no_copy_holds_the_value(
    _cluster: None, prefect_harness: None, tmp_path: Path
) -> None:
    import asyncio

    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client

    from slurmgate.flows.allocation import allocation

    hf, endpoint_token = _value("hf-block"), _value("endpoint-block")
    Secret(value=hf).save("sg-test-hf-token", overwrite=True)
    Secret(value=endpoint_token).save("sg-test-endpoint-token", overwrite=True)
    data = example_data()
    data["endpoint_token"] = {"secret": "sg-test-endpoint-token"}
    data["deployments"][0]["env"]["HF_TOKEN"] = {"secret": "sg-test-hf-token"}
    data["client"] = {
        "command": [sys.executable, "-c", LEAKY_CLIENT],
        "env": {"HF_TOKEN": {"secret": "sg-test-hf-token"}},
    }
    runs_root = tmp_path / "runs"
    state = allocation(
        spec=AllocationSpec.from_data(data), runs_dir=str(runs_root), return_state=True
    )
    assert state.is_failed()
    (run_dir,) = runs_root.iterdir()
    client_log = next(run_dir.glob("[0-9][0-9]-client.log")).read_text()
    assert f"raw {hf}" in client_log  # resolved from the block, on this host, for the client

    async def everything_prefect_holds() -> dict[str, str]:
        async with get_client() as client:
            runs = await client.read_flow_runs()
            logs = await client.read_logs()
            artifacts = await client.read_artifacts()
        mine = [r for r in runs if r.name.startswith("allocation-local-stub")]
        return {
            "parameters": json.dumps([r.parameters for r in mine], default=str),
            "states": json.dumps([r.state.message if r.state else "" for r in mine]),
            "logs": "\n".join(log.message for log in logs),
            "artifacts": json.dumps([(a.key, a.data) for a in artifacts], default=str),
        }

    held = asyncio.run(everything_prefect_holds())
    assert "sg-test-hf-token" in held["parameters"]  # the reference is what Prefect keeps
    assert "serving --api-key ***" in held["states"] + held["logs"]
    assert f"# Run {run_dir.name}" in held["artifacts"]  # the record artifact was published
    # the endpoints' metrics were read with the token (their /metrics wants it)
    assert "allocation-endpoint-stats" in held["artifacts"]
    assert "slurmgate_endpoint" in held["artifacts"]
    for where, text in held.items():
        assert hf not in text and endpoint_token not in text, where
    assert hf not in next(run_dir.glob("record.json")).read_text()


# -- one list of credential shapes, applied to every argv element, hook command and env value --

GHP = "ghp_" + "Z9" * 18
HF = "hf_" + "q7" * 15
SK = "sk-" + "w3" * 15


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        ("lane", ["bash", "-c", f"vllm serve m --api-key {SK}"], "deployments[0].command"),
        ("client", ["python", "client.py", "--token", GHP], "client.command"),
        ("client", ["bash", "-c", f"HF_TOKEN={HF} python c.py"], "client.command"),
        (
            "client",
            ["curl", "-H", "Authorization: Bearer opaque-value-123", "http://x"],
            "client.command",
        ),
        ("client", ["git", "clone", "https://bot:hunter22@git.example/r.git"], "client.command"),
        ("client", ["git", "clone", f"https://{GHP}@github.com/acme/r.git"], "client.command"),
        ("hook", f"git clone https://x-access-token:{GHP}@github.com/acme/r", "hooks.prolog"),
        ("hook", f"curl -H 'Authorization: Bearer {HF}' https://hub", "hooks.prolog"),
        ("env-name", "GITHUB_PAT", "client.env"),
        ("env-name", "GCP_CREDENTIALS", "deployments[0].env"),
        ("env-value", f"--api-key {SK}", "client.env"),
        ("env-value", HF, "deployments[0].env"),
    ],
)
def test_a_literal_credential_anywhere_in_the_spec_is_refused(
    where: str, value: Any, field: str
) -> None:
    data = example_data()
    secret = "literal-secret-value"
    if where == "lane":
        data["deployments"][0]["command"] = value
    elif where == "client":
        data["client"]["command"] = value
    elif where == "hook":
        data["hooks"] = {"prolog": {"commands": ["true", value]}}
    elif where == "env-name":
        target = data["client"] if field == "client.env" else data["deployments"][0]
        target["env"] = {value: secret}
    else:
        target = data["client"] if field == "client.env" else data["deployments"][0]
        target["env"] = {"EXTRA": value}
    with pytest.raises(SpecError) as caught:
        AllocationSpec.from_data(data)
    text = str(caught.value)
    assert caught.value.problems[0][0].startswith(field), text
    assert "{secret:" in text
    for leaked in (GHP, HF, SK, secret, "hunter22", "opaque-value-123"):
        assert leaked not in text


@pytest.mark.parametrize(
    "command",
    [
        'curl -H "Authorization: Bearer $GITHUB_TOKEN" https://api.github.com',
        "git clone https://x-access-token:${GH_TOKEN}@github.com/acme/r",
        "export HF_TOKEN=$(cat /run/secrets/hf) && true",
        "vllm serve m --max-num-batched-tokens 8192",
    ],
)
def test_a_reference_to_a_credential_is_not_a_credential(command: str) -> None:
    data = example_data()
    data["hooks"] = {"prolog": {"commands": [command]}}
    data["client"]["command"] = ["bash", "-c", command]
    spec = AllocationSpec.from_data(data)
    assert spec.client.command[-1] == command
