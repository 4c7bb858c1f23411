"""Where our Slurm commands find their configuration: SLURM_CONF, else what `cluster up` left."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from slurmgate.paths import UntrustedRecord, check_trusted, state_dir

CLUSTER_RECORD_NAME = "slurm-cluster.json"
# The record is a few hundred bytes; anything larger was not written by `cluster up`.
MAX_CLUSTER_RECORD_BYTES = 64 * 1024


class BundledCluster(BaseModel):
    """The bundled cluster `slurmgate cluster up` last brought up, and whether it started it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    slurm_conf: str
    directory: str
    # False when the cluster was already running (e.g. started by the test script): then
    # `cluster down` leaves it alone unless forced, so a README walk-through in a test suite
    # never stops the suite's own cluster.
    started_by_up: bool


def cluster_record_path() -> Path:
    """The record's file: `slurm-cluster.json` in the state directory ($SLURMGATE_STATE_DIR)."""
    return state_dir() / CLUSTER_RECORD_NAME


def save_cluster(cluster: BundledCluster) -> Path:
    """Write the record atomically, readable and writable by this user only."""
    path = cluster_record_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(cluster.model_dump_json() + "\n")
    os.replace(tmp, path)
    return path


def load_cluster() -> BundledCluster | None:
    """The record, or None when there is none or it cannot be trusted or parsed.

    The record steers every Slurm call that has no SLURM_CONF, so only a regular file of this
    user that nobody else can write counts (the run records' rule).
    """
    path = cluster_record_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            check_trusted(path, os.fstat(fh.fileno()))
            data = fh.read(MAX_CLUSTER_RECORD_BYTES + 1)
    except (OSError, UntrustedRecord):
        return None
    if len(data) > MAX_CLUSTER_RECORD_BYTES:
        return None
    try:
        return BundledCluster.model_validate_json(data)
    except ValidationError:
        return None


def forget_cluster() -> None:
    """Remove the record (safe when there is none)."""
    with contextlib.suppress(FileNotFoundError):
        cluster_record_path().unlink()


def recorded_slurm_conf() -> str | None:
    """The recorded cluster's slurm.conf, if it still exists (a stale record is ignored)."""
    cluster = load_cluster()
    if cluster is None or not Path(cluster.slurm_conf).is_file():
        return None
    return cluster.slurm_conf
