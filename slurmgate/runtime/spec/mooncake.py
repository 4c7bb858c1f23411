"""A deployment's Mooncake store: its master and metadata server, and what its workers are told."""

from __future__ import annotations

from pydantic import Field, field_validator

from slurmgate.runtime.engines import mooncake
from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import StrictModel, port_field
from slurmgate.runtime.spec.roles import MAX_ROLE_ARGS, checked_args

StoreValue = str | int | float | bool
# Keys of the store's JSON the runtime writes itself: the master is the run's own.
OWNED_KEYS = ("master_server_address",)


class MooncakeSpec(StrictModel):
    """Mooncake's master and HTTP metadata server on the client node, before the workers."""

    store_config: dict[str, StoreValue] = Field(
        default_factory=dict,
        max_length=64,
        description="the store's JSON every worker reads at MOONCAKE_CONFIG_PATH "
        "(global_segment_size, local_buffer_size, protocol, device_name, metadata_server, …); "
        "the master's address is the run's; unset metadata_server and local_hostname: the run's "
        "metadata server and the lane's node address",
    )
    master_command: list[str] = Field(
        default_factory=lambda: list(mooncake.MASTER_COMMAND),
        min_length=1,
        description="the master's binary (mooncake-transfer-engine's mooncake_master)",
    )
    master_args: list[str] = Field(
        default_factory=list,
        max_length=MAX_ROLE_ARGS,
        description="the master's own flags, after the launcher's (e.g. "
        "-eviction_high_watermark_ratio=0.9)",
    )
    metadata_command: list[str] = Field(
        default_factory=lambda: list(mooncake.METADATA_COMMAND),
        min_length=1,
        description="the HTTP metadata server's binary (mooncake_http_metadata_server)",
    )
    master_port: int = port_field(8700, "the master's RPC port on the client node")
    metadata_port: int = port_field(8701, "the HTTP metadata server's port on the client node")
    metrics_port: int = port_field(8702, "the master's metrics and /health, on loopback")
    across_hosts: bool = Field(
        default=False,
        description="the site accepts the master and metadata server on the client node's "
        "address when workers run on other nodes: neither authenticates its clients (Mooncake "
        "has no option for it), so any host that reaches that address can read and write the "
        "store; unset, such a run is refused and a deployment on the client node alone keeps "
        "them on loopback",
    )

    @field_validator("store_config")
    @classmethod
    def _store_config(cls, v: dict[str, StoreValue]) -> dict[str, StoreValue]:
        for key in v:
            if key in OWNED_KEYS:
                raise problem(
                    "mooncake.store_config",
                    f"{key} is the run's own master",
                    f"remove {key}; the runtime writes it",
                )
        return v

    @field_validator("master_args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return checked_args(v)

    @property
    def ports(self) -> dict[str, int]:
        return mooncake.ports(self.master_port, self.metadata_port, self.metrics_port)
