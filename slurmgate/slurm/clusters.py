"""Capacity reads of several Slurm clusters: each pool read from its own, each failing open alone.

A pool's `pool_partitions` entry may name a `cluster` of `slurm_clusters`; without one it is
in the controller's own Slurm (its `SLURM_CONF`, or `SLURMGATE_SLURMRESTD_URL`). Each cluster
is read on its own (`scontrol`/`squeue` with its `SLURM_CONF`, or its slurmrestd), and one that
does not answer leaves only its pools at runner-only capacity: the read raises
`CapacityUnread` with what the other clusters said, and the tick warns once per unread
cluster. A cluster that failed is not asked again for `retry_after_s` (the rest of a tick, so
a controller that times out does not stall the re-read), then is asked again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import SecretStr, ValidationError

from slurmgate.admission.capacity import CapacityUnread, NodeCapacity
from slurmgate.errors import one_line
from slurmgate.settings.admission import PoolPartition, SlurmCluster
from slurmgate.settings.handed import named
from slurmgate.settings.slurm import SlurmRestSettings
from slurmgate.slurm.capacity import read_pool_capacity
from slurmgate.slurm.commands import SlurmError
from slurmgate.slurm.slurmrestd import read_rest_capacity

OWN_CLUSTER = "(own)"
"""How the controller's own Slurm (no `cluster` in a pool's partition) is named in warnings."""


class ClusterReads:
    """The tick's capacity read over every cluster the mapped pools name (`ReadCapacity`)."""

    def __init__(
        self,
        partitions: Mapping[str, PoolPartition],
        clusters: Mapping[str, SlurmCluster],
        own: Callable[[Mapping[str, PoolPartition]], dict[str, NodeCapacity]],
        *,
        retry_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clusters = clusters
        self.own = own
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.groups: dict[str, dict[str, PoolPartition]] = {}
        for pool, target in sorted(partitions.items()):
            self.groups.setdefault(target.cluster or OWN_CLUSTER, {})[pool] = target
        self.failed: dict[str, tuple[float, str]] = {}

    def __call__(self) -> dict[str, NodeCapacity]:
        capacity: dict[str, NodeCapacity] = {}
        unread: dict[str, tuple[str, tuple[str, ...]]] = {}
        for name, pools in self.groups.items():
            failed = self.failed.get(name)
            if failed is not None and self.clock() - failed[0] < self.retry_after_s:
                unread[name] = (failed[1], tuple(pools))
                continue
            try:
                capacity.update(self.read(name, pools))
            except Exception as exc:
                self.failed[name] = (self.clock(), one_line(exc))
                unread[name] = (one_line(exc), tuple(pools))
                continue
            self.failed.pop(name, None)
        if unread:
            raise CapacityUnread(capacity, unread)
        return capacity

    def read(self, name: str, pools: Mapping[str, PoolPartition]) -> dict[str, NodeCapacity]:
        """One cluster's pools, from its own Slurm."""
        if name == OWN_CLUSTER:
            return self.own(pools)
        cluster = self.clusters[name]
        if cluster.slurm_conf is not None:
            return read_pool_capacity(
                pools, timeout=cluster.timeout_s, slurm_conf=cluster.slurm_conf
            )
        return read_rest_capacity(rest_settings_of(name, cluster), pools)


def rest_settings_of(name: str, cluster: SlurmCluster) -> SlurmRestSettings:
    """The slurmrestd settings of one cluster: its URL, user and version, and its token read
    now from its variable or file (none of the SLURMGATE_SLURMRESTD_* environment, which is
    the controller's own cluster's)."""
    token: str | None = None
    if cluster.slurmrestd_token_env:
        token = (named(cluster.slurmrestd_token_env) or "").strip()
        if not token:
            raise SlurmError(
                ["slurmrestd", str(cluster.slurmrestd_url)],
                f"of cluster {name} has no token: ${cluster.slurmrestd_token_env} is empty; "
                "export it in the controller's environment",
            )
    elif cluster.slurmrestd_token_file:
        try:
            token = Path(cluster.slurmrestd_token_file).read_text().strip()
        except OSError as exc:
            raise SlurmError(
                ["slurmrestd", str(cluster.slurmrestd_url)],
                f"of cluster {name}: slurmrestd_token_file {cluster.slurmrestd_token_file} "
                f"cannot be read ({exc.strerror}); check the path and its mode",
            ) from None
    try:
        return SlurmRestSettings.model_validate(
            {
                "url": cluster.slurmrestd_url,
                "user": cluster.slurmrestd_user,
                "token": SecretStr(token) if token else None,
                "api_version": cluster.slurmrestd_api_version,
                "timeout_s": cluster.timeout_s,
            }
        )
    except ValidationError as exc:
        said = "; ".join(
            str(e["msg"]).removeprefix("Value error, ") for e in exc.errors(include_input=False)
        ).replace("SLURMGATE_SLURMRESTD_URL", "slurmrestd_url")
        raise SlurmError(
            ["slurmrestd", str(cluster.slurmrestd_url)[:80]],
            f"of cluster {name} cannot be used: {said}",
        ) from None
