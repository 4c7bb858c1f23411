"""A deployment's frontend: the field's own router before its role workers, and its services."""

from __future__ import annotations

from pydantic import Field, field_validator

from slurmgate.runtime.engines import frontends
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import StrictModel, port_field
from slurmgate.runtime.spec.roles import (
    MAX_ROLE_ARGS,
    RolesSpec,
    checked_args,
    checked_plain_env,
)


class FrontendSpec(StrictModel):
    """The field's own router or frontend, started on the client node in front of the workers."""

    type: frontends.FrontendName = Field(
        description="dynamo (with the etcd and NATS it needs), sglang-router, vllm-router, or "
        "trtllm-serve (disaggregated); the logical endpoint then routes to it"
    )
    command: list[str] | None = Field(
        default=None,
        min_length=1,
        description="its argv before the launcher's flags; default: the type's own (python3 -m "
        "dynamo.frontend, python3 -m sglang_router.launch_router, vllm-router, trtllm-serve "
        "disaggregated)",
    )
    args: list[str] = Field(
        default_factory=list, max_length=MAX_ROLE_ARGS, description="its own flags, last"
    )
    env: dict[str, str] = Field(default_factory=dict, description="its own env, plain values")
    port: int = port_field(8000, "its HTTP port on the client node")
    request_plane: frontends.RequestPlane = Field(
        default="tcp", description="Dynamo's request plane between frontend and workers"
    )
    discovery: frontends.DiscoveryName = Field(
        default="etcd",
        description="Dynamo: where workers register: etcd (a service lane on the client node, "
        "mutual TLS across hosts) or file (DYN_FILE_KV: a directory of the run's in "
        "discovery_dir, which every node must share; preflight proves it)",
    )
    discovery_dir: str | None = Field(
        default=None,
        description="Dynamo with discovery file: an absolute directory on a filesystem every "
        "node mounts, where the run makes (and at cleanup removes) a directory of its own; "
        "default: the run's directory",
    )
    etcd_port: int = port_field(2379, "Dynamo: etcd's client port on the client node (+1: peers)")
    nats_port: int = port_field(4222, "Dynamo: NATS's port on the client node")
    nats_monitor_port: int = port_field(8222, "Dynamo: NATS's monitoring port (readiness)")
    etcd_command: list[str] = Field(
        default_factory=lambda: ["etcd"], min_length=1, description="Dynamo: etcd's binary"
    )
    nats_command: list[str] = Field(
        default_factory=lambda: ["nats-server"],
        min_length=1,
        description="Dynamo: the NATS server's binary",
    )
    startup_timeout_s: float = Field(
        default=600.0, gt=0, description="seconds it has to list every worker once they are up"
    )

    @field_validator("discovery_dir")
    @classmethod
    def _discovery_dir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise problem(
                "discovery_dir",
                f"{v!r} is not an absolute path",
                "give the absolute path of a directory every node mounts",
            )
        return v

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return checked_args(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return checked_plain_env(v)

    @property
    def profile(self) -> frontends.FrontendProfile:
        return frontends.FRONTENDS[self.type]

    @property
    def argv_head(self) -> list[str]:
        """Its command: the spec's, or the type's own."""
        return list(self.command or self.profile.command)

    @property
    def services(self) -> tuple[str, ...]:
        """The service lanes it needs: the type's, without etcd when discovery is a directory."""
        return tuple(
            s for s in self.profile.services if not (s == "etcd" and self.discovery == "file")
        )

    @property
    def service_ports(self) -> dict[str, int]:
        return {
            "etcd": self.etcd_port,
            "etcd_peer": self.etcd_port + 1,
            "nats": self.nats_port,
            "nats_monitor": self.nats_monitor_port,
        }


# Engines whose disaggregated serving passes the prefill's answer to the decode, and the router
# that does it (vLLM's kv_transfer_params, TensorRT-LLM's disaggregated_params).
PD_ROUTERS = {"vllm": "vllm-router", "trtllm": "trtllm-serve"}


def check_frontend_pairing(
    engine: str, frontend: FrontendSpec | None, roles: RolesSpec | None
) -> None:
    """Refuse a frontend the engine cannot have, or an engine left without the one it needs."""
    needed = engines.profile(engine).frontend
    if frontend is None:
        if needed is not None:
            raise problem(
                "frontend",
                f"engine {engine}'s workers serve no client HTTP: they need the {needed} frontend",
                f"add frontend: {{type: {needed}}}",
            )
        if roles is not None and roles.disaggregated and engine in PD_ROUTERS:
            # slurmgate's endpoint pairs SGLang's way (bootstrap host, port and room in both
            # bodies); vLLM and TensorRT-LLM hand the prefill's answer (kv_transfer_params,
            # disaggregated_params) to the decode, which it does not: both would prefill
            raise problem(
                "frontend",
                f"engine {engine}'s prefill and decode need their own router: slurmgate's "
                "endpoint pairs requests SGLang's way, not with the prefill's KV-transfer "
                "parameters",
                f"add frontend: {{type: {PD_ROUTERS[engine]}}}",
            )
        return
    profile = frontend.profile
    if frontend.type != "dynamo" and (
        "discovery" in frontend.model_fields_set or frontend.discovery_dir
    ):
        raise problem(
            "frontend.discovery",
            f"is Dynamo's; {frontend.type} finds its workers by the URLs it is given",
            "remove discovery and discovery_dir",
        )
    if frontend.discovery_dir is not None and frontend.discovery != "file":
        raise problem(
            "frontend.discovery_dir",
            "is the directory of discovery file",
            "set discovery: file, or remove discovery_dir",
        )
    if engine not in profile.engines:
        raise problem(
            "frontend.type",
            f"{frontend.type} does not front engine {engine}",
            "use it with engine " + " or ".join(profile.engines),
        )
    if roles is None:
        raise problem(
            "frontend",
            "a frontend fronts a deployment's role workers",
            "give roles (prefill and decode, or agg), or remove frontend",
        )
    if profile.pd_only and not roles.disaggregated:
        raise problem(
            "frontend.type",
            f"{frontend.type} fronts prefill and decode workers only",
            "give roles.prefill and roles.decode, or remove frontend",
        )
