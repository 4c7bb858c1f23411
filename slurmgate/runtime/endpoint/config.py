"""The logical endpoint's settings and flags: parsed and rendered in one place."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from slurmgate.settings.handed import PROCESS_ENVIRONMENT

DEFAULT_PROG = "python -m slurmgate.runtime.endpoint"
# The bearer token comes from the environment only: argv is world-readable in /proc and `ps`.
TOKEN_ENV = "SLURMGATE_ENDPOINT_TOKEN"
# RFC 6750's b64token: what HAProxy's admin command line takes as it is (``haproxy.py``).
_B64TOKEN = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")
# Who forwards the endpoint's requests (``EndpointConfig.data_plane``).
DataPlane = Literal["python", "haproxy"]
# A Prometheus metric name (the exposition format's rule).
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]{0,199}$")
# Every setting past name, listen and backends: its flag is --NAME-WITH-DASHES.
TUNING_FLAGS: dict[str, type] = {
    "max_waiting": int,
    "retry_after": float,
    "sample_interval": float,
    "stale_after": float,
    "metrics_timeout": float,
    "max_metrics_bytes": int,
    "max_attempts": int,
    "breaker_failures": int,
    "breaker_open_s": float,
    "max_body_bytes": int,
    "max_pd_body_bytes": int,
    "pd_parse_timeout": float,
    "max_buffered_bytes": int,
    "body_timeout": float,
    "max_connections": int,
    "connect_timeout": float,
    "read_timeout": float,
    "first_byte_timeout": float,
    "health_timeout": float,
    "health_interval": float,
    "pool_size": int,
    "keepalive_timeout": float,
    "backend_health_path": str,
    "backend_metrics_path": str,
    "queue_waiting_metric": str,
    "queue_running_metric": str,
    "data_plane": str,
}


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"{url!r} is not a backend base URL: use http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a path or query: give only http://HOST:PORT")
    return f"http://{parts.netloc}"


class PrefillBackend(BaseModel):
    """A prefill lane head and the port of its bootstrap server (None: JSON null, as
    sglang-router sends when its `--prefill URL` has no port; the engine's default applies)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _base_url(value)


class EndpointConfig(BaseModel):
    """Settings of one logical endpoint; every field maps to a command-line flag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="deployment name, used in logs and metrics")
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="listen port; 0 picks a free one")
    backends: list[str] = Field(
        default_factory=list, description="lane heads as http://HOST:PORT (aggregated)"
    )
    prefill: list[PrefillBackend] = Field(
        default_factory=list,
        description="prefill lane heads with their bootstrap ports (disaggregated; with decode)",
    )
    decode: list[str] = Field(
        default_factory=list, description="decode lane heads as http://HOST:PORT (with prefill)"
    )
    max_waiting: int = Field(default=128, ge=0, description="per-lane queue limit")
    retry_after: float = Field(default=1.0, ge=0, description="Retry-After seconds; 0 omits it")
    sample_interval: float = Field(
        default=0.1, gt=0, description="seconds between two scrapes of a lane's queue metric"
    )
    stale_after: float = Field(
        default=1.0,
        gt=0,
        description="seconds a lane's queue sample counts; past it, or with no sample, the "
        "lane's queue is unknown and its limit fails open (the lane takes requests)",
    )
    metrics_timeout: float = Field(
        default=0.5,
        gt=0,
        description="seconds a scrape of a lane's /metrics may take; past it the scrape is "
        "abandoned and counts as failed (keep it and --sample-interval under --stale-after)",
    )
    max_metrics_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        description="bytes of a lane's /metrics page read at most; a larger page counts as a "
        "failed scrape (a full vLLM page is ~100 KB, and each MiB costs ~25 ms to scan)",
    )
    max_attempts: int = Field(default=3, ge=1)
    breaker_failures: int = Field(
        default=5,
        ge=0,
        description="failed answers in a row (5xx, resets, timeouts; never 4xx) that take a "
        "lane out of rotation even while its health probe passes; 0 turns the breaker off",
    )
    breaker_open_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds an opened breaker keeps its lane out before one request probes "
        "it; doubled each time the probe fails (at most 8 times)",
    )
    max_body_bytes: int = Field(default=100 * 1024 * 1024, ge=0)
    max_pd_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=0,
        description="request body limit of a prefill/decode deployment, whose every body is "
        "parsed as JSON to be paired: a prompt is a few MB at most, and a parse costs many "
        "times its body; over it a request is answered 413 (the lower of this and "
        "--max-body-bytes holds)",
    )
    pd_parse_timeout: float = Field(
        default=5.0,
        gt=0,
        description="seconds the parse of one prefill/decode body may take in the endpoint's "
        "parser process (bodies over 16 KiB; 8 MiB of token ids takes about 0.5 s); past it "
        "the request is answered 413 and the process replaced (raise it with "
        "--max-pd-body-bytes)",
    )
    max_buffered_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        description="request bodies held in memory at once, over all requests; a body that "
        "does not fit is answered 429 (bodies are kept whole so another replica can retry them)",
    )
    body_timeout: float = Field(
        default=60.0,
        gt=0,
        description="seconds from a request's first byte until its whole body must be in; "
        "past it the request is answered 408 and its connection closed",
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="client connections open at once; past it a new one is answered 503 and "
        "closed (lowered to what the file-descriptor limit leaves after the lanes' pool)",
    )
    connect_timeout: float = Field(default=5.0, gt=0)
    read_timeout: float = Field(
        default=3600.0, gt=0, description="idle seconds allowed between two upstream reads"
    )
    first_byte_timeout: float = Field(
        default=600.0,
        gt=0,
        description="seconds a backend may take to start its answer (a non-streaming "
        "completion starts only when it is done); past it the attempt fails and is retried",
    )
    health_timeout: float = Field(default=2.0, gt=0)
    health_interval: float = Field(
        default=1.0, gt=0, description="seconds between two health probes of a lane"
    )
    backend_health_path: str = "/health"
    backend_metrics_path: str = "/metrics"
    queue_waiting_metric: str = Field(
        default="vllm:num_requests_waiting",
        description="the backends' Prometheus gauge of waiting requests (the queue the limit "
        "applies to); the deployment's engine decides it",
    )
    queue_running_metric: str = Field(
        default="vllm:num_requests_running",
        description="the backends' Prometheus gauge of running requests (what a saturated "
        "lane can run at once)",
    )
    pool_size: int = Field(default=256, ge=1, description="pooled upstream connections in all")
    keepalive_timeout: float = Field(
        default=4.0,
        gt=0,
        description="idle upstream connections close after this; keep it under the backends' "
        "own keep-alive (uvicorn and vLLM default to 5 s) so a pooled connection is never "
        "reused just as the backend closes it",
    )
    data_plane: DataPlane = Field(
        default="python",
        description="who forwards requests: python (the endpoint itself, every rule) or "
        "haproxy (Debian's HAProxy forwards the common request at nginx's cost, the endpoint "
        "decides which lanes take work and answers the rest; aggregated deployments only)",
    )
    token: SecretStr | None = Field(
        default=None,
        description=f"bearer token every request but GET /health must carry; from ${TOKEN_ENV} "
        "only, never a flag",
    )

    @field_validator("backends", "decode")
    @classmethod
    def _backends_are_base_urls(cls, value: list[str]) -> list[str]:
        cleaned = [_base_url(url) for url in value]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("the same backend is listed twice: list each lane head once")
        return cleaned

    @field_validator("backend_health_path", "backend_metrics_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/") or any(c in value for c in " ?#"):
            raise ValueError(f"{value!r} must be an absolute path like /health, without a query")
        return value

    @field_validator("queue_waiting_metric", "queue_running_metric")
    @classmethod
    def _metric_name(cls, value: str) -> str:
        if not _METRIC_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a Prometheus metric name: use letters, digits, _ and :, "
                "e.g. vllm:num_requests_waiting"
            )
        return value

    @model_validator(mode="after")
    def _aggregated_or_disaggregated(self) -> EndpointConfig:
        if self.backends and (self.prefill or self.decode):
            raise ValueError(
                "--backend and --prefill/--decode are both given: list an aggregated "
                "deployment's lanes with --backend, a disaggregated one's with --prefill and "
                "--decode"
            )
        if not self.backends and not (self.prefill and self.decode):
            raise ValueError(
                "no backends: give --backend URL (aggregated), or at least one --prefill URL "
                "[BOOTSTRAP_PORT] and one --decode URL (disaggregated)"
            )
        urls = [p.url for p in self.prefill] + self.decode
        if len(set(urls)) != len(urls):
            raise ValueError("the same backend is listed twice: list each lane head once")
        return self

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def all_backends(self) -> list[str]:
        """Every lane head: the aggregated ones, or prefill then decode."""
        return self.backends or [p.url for p in self.prefill] + self.decode

    @model_validator(mode="after")
    def _haproxy_forwards_what_it_can(self) -> EndpointConfig:
        if self.data_plane != "haproxy":
            return self
        if self.disaggregated:
            raise ValueError(
                "--data-plane haproxy forwards aggregated deployments only: a prefill/decode "
                "pair is made by the endpoint itself; leave --data-plane at python"
            )
        token = self.token.get_secret_value() if self.token is not None else ""
        if token and (len(token) > 512 or not _B64TOKEN.match(token)):
            raise ValueError(
                f"--data-plane haproxy needs ${TOKEN_ENV} to be a bearer token of letters, "
                "digits and -._~+/ (at most 512), as `secrets.token_urlsafe()` makes; or leave "
                "--data-plane at python"
            )
        return self

    @model_validator(mode="after")
    def _one_body_fits_the_budget(self) -> EndpointConfig:
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                "max_buffered_bytes is below max_body_bytes: raise --max-buffered-bytes or "
                "lower --max-body-bytes, or no body of the largest allowed size could be taken"
            )
        return self

    @model_validator(mode="after")
    def _a_timely_scrape_is_fresh(self) -> EndpointConfig:
        # A page that comes within the timeout, one interval after the last, must still find
        # the last sample fresh, or a lane that answers in time loses its limit between samples.
        if self.metrics_timeout + self.sample_interval >= self.stale_after:
            raise ValueError(
                "--metrics-timeout plus --sample-interval is not under --stale-after: raise "
                "--stale-after or lower the others, or a lane whose /metrics answers in time "
                "would still lose its queue limit between samples"
            )
        return self

    @field_validator("token")
    @classmethod
    def _empty_token_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value() else None

    @property
    def retry_after_header(self) -> bytes | None:
        if self.retry_after <= 0:
            return None
        seconds = self.retry_after
        return (str(int(seconds)) if seconds == int(seconds) else f"{seconds:g}").encode()

    def argv(self) -> list[str]:
        """The flags that make `parse_config` build this config again; defaults are left out."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        args = ["--name", self.name, "--listen", f"{host}:{self.port}"]
        for url in self.backends:
            args += ["--backend", url]
        for prefill in self.prefill:
            boot = [] if prefill.bootstrap_port is None else [str(prefill.bootstrap_port)]
            args += ["--prefill", prefill.url, *boot]
        for url in self.decode:
            args += ["--decode", url]
        for name in TUNING_FLAGS:
            value = getattr(self, name)
            if value != type(self).model_fields[name].default:
                args += [_flag(name), str(value)]
        return args


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (for example 127.0.0.1:9000)")
    return host.strip("[]"), int(port)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_config(
    argv: list[str] | None = None,
    prog: str = DEFAULT_PROG,
    environ: Mapping[str, str] = PROCESS_ENVIRONMENT,
) -> EndpointConfig:
    """Build the config from the command line (and the token from the environment); bad values
    exit 2 naming the flag and the fix."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Logical endpoint: routes, retries and streams to a deployment's lane heads.",
        epilog=(
            "Example: slurmgate endpoint --name chat --listen 127.0.0.1:9000 "
            "--backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 --max-waiting 4"
        ),
    )
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", required=True, type=_parse_listen, metavar="HOST:PORT")
    parser.add_argument("--backend", action="append", default=[], metavar="http://HOST:PORT")
    parser.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        default=[],
        metavar="ARG",
        help="a prefill lane: http://HOST:PORT [BOOTSTRAP_PORT] (as sglang-router's --prefill)",
    )
    parser.add_argument("--decode", action="append", default=[], metavar="http://HOST:PORT")
    for name, kind in TUNING_FLAGS.items():
        parser.add_argument(_flag(name), dest=name, type=kind, default=None)
    ns = parser.parse_args(argv)
    host, port = ns.listen
    prefill: list[dict[str, Any]] = []
    for words in ns.prefill:
        if len(words) > 2 or (len(words) == 2 and not words[1].isdigit()):
            parser.error(
                f"--prefill {' '.join(words)}: give http://HOST:PORT and optionally its "
                "bootstrap port, e.g. --prefill http://10.0.0.1:30000 8998"
            )
        prefill.append({"url": words[0], "bootstrap_port": int(words[1]) if words[1:] else None})
    values: dict[str, Any] = {
        "name": ns.name,
        "host": host,
        "port": port,
        "backends": ns.backend,
        "prefill": prefill,
        "decode": ns.decode,
    }
    values.update({k: getattr(ns, k) for k in TUNING_FLAGS if getattr(ns, k) is not None})
    if environ.get(TOKEN_ENV):
        values["token"] = SecretStr(environ[TOKEN_ENV])
    try:
        return EndpointConfig(**values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = str(err["loc"][0]) if err["loc"] else "?"
            if not err["loc"]:  # a rule over several fields names its flags itself
                lines.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            flag = {"backends": "backend", "host": "listen", "port": "listen"}.get(loc, loc)
            lines.append(f"--{flag.replace('_', '-')}: {err['msg']}")
        parser.error("; ".join(lines))
    raise AssertionError("unreachable")
