"""Several Slurm clusters per controller, without Slurm: the settings that map pools to
clusters, and each cluster's read failing alone, asked again only after a while."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from slurmgate.admission.capacity import CapacityUnread
from slurmgate.settings.admission import AdmissionSettings
from slurmgate.slurm.capacity import read_pool_capacity
from slurmgate.slurm.clusters import OWN_CLUSTER, ClusterReads


def test_each_unreachable_cluster_fails_alone_naming_why_and_is_asked_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "own.conf"))  # the controller's own: none
    monkeypatch.delenv("WEST_TOKEN", raising=False)
    settings = AdmissionSettings(
        slurm_clusters={
            "east": {"slurm_conf": str(tmp_path / "east.conf")},
            "west": {
                "slurmrestd_url": f"unix:{tmp_path}/west.sock",
                "slurmrestd_token_env": "WEST_TOKEN",
            },
        },
        pool_partitions={
            "a": "debug",
            "e": {"partition": "gpu", "cluster": "east"},
            "w": {"partition": "gpu", "cluster": "west"},
            "w2": {"partition": "cpu", "cluster": "west"},
        },
    )
    now = [0.0]
    reads = ClusterReads(
        settings.pool_partitions, settings.slurm_clusters, read_pool_capacity, clock=lambda: now[0]
    )
    with pytest.raises(CapacityUnread) as caught:
        reads()
    unread = caught.value.unread
    assert unread[OWN_CLUSTER] == (
        f"SlurmNotConfigured: SLURM_CONF names {tmp_path}/own.conf, which does not exist: "
        "export SLURM_CONF=/path/to/slurm.conf, or start the bundled cluster with "
        "`slurmgate cluster up`",
        ("cluster:a",),
    )
    assert f"SLURM_CONF names {tmp_path}/east.conf" in unread["east"][0]
    assert "$WEST_TOKEN is empty" in unread["west"][0]
    assert unread["west"][1] == ("cluster:w", "cluster:w2")  # one read per cluster
    assert caught.value.capacity == {}
    # within retry_after_s a failed cluster is not asked again (the re-read of the same tick)
    monkeypatch.setenv("WEST_TOKEN", "sekrit-token")
    with pytest.raises(CapacityUnread) as again:
        reads()
    assert "$WEST_TOKEN is empty" in again.value.unread["west"][0]
    now[0] = 31.0
    with pytest.raises(CapacityUnread) as later:
        reads()
    west = later.value.unread["west"][0]
    assert "slurmrestd GET" in west and "sekrit" not in str(later.value)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"pool_partitions": {"a": {"partition": "p", "cluster": "x"}}}, "'x' is not in slurm_c"),
        ({"slurm_clusters": {"x": {}}}, "exactly one of slurm_conf"),
        ({"slurm_clusters": {"x": {"slurm_conf": "/a", "slurmrestd_url": "unix:/b"}}}, "exactly"),
        ({"slurm_clusters": {"x": {"slurm_conf": "/a", "token": "t"}}}, "token"),
        (
            {"slurm_clusters": {"x": {"slurmrestd_url": "unix:/b", "slurmrestd_token_env": "A B"}}},
            "token_env",
        ),
    ],
)
def test_bad_cluster_settings_are_refused_naming_the_field(
    knobs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        AdmissionSettings(**knobs)  # type: ignore[arg-type]
