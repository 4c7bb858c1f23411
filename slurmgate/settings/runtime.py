"""Allocation runtime settings: heartbeat, reaper, node-failure retries, output collection."""

from __future__ import annotations

from slurmgate.settings.part import Part, variable


class LedgerSettings(Part):
    """The heartbeat a run's controller writes, and how the reaper judges it."""

    heartbeat_s: float = variable(
        "SLURMGATE_HEARTBEAT_S",
        "Seconds between two beats of a controller in its allocation's job comment.",
        60.0,
        gt=0,
        le=86_400,
    )
    reap_stale_s: float = variable(
        "SLURMGATE_REAP_STALE_S",
        "A controller on another host whose last beat is older than this (seconds) is gone.",
        600.0,
        gt=0,
        le=86_400,
    )
    reap_all_users: bool = variable(
        "SLURMGATE_REAP_ALL_USERS",
        "The scheduled reap also reaps other users' runs whose controller is gone "
        "(on for 1, true, yes or on).",
        False,
    )


class NodeRetrySettings(Part):
    """What a run does when one node fails it (each a yes/no: 1, true, yes, on or 0, false, no,
    off)."""

    node_retry: bool = variable(
        "SLURMGATE_NODE_RETRY",
        "Run the spec once more, on a new allocation, without a node that alone failed the run.",
        True,
    )
    drain_failed_nodes: bool = variable(
        "SLURMGATE_DRAIN_FAILED_NODES", "Drain that node in Slurm before the retry.", False
    )


class OutputsSettings(Part):
    """What a run collects from its nodes before cleanup: every lane's log and the results
    its lanes and client write (each file bounded, its head and tail kept)."""

    collect: bool = variable(
        "SLURMGATE_OUTPUTS_COLLECT",
        "Collect the lanes' logs and results from every node before cleanup "
        "(1, true, yes, on or 0, false, no, off).",
        True,
    )
    max_file_bytes: int = variable(
        "SLURMGATE_OUTPUTS_MAX_FILE_BYTES",
        "Bytes kept of each collected file; a larger one keeps its first and last halves.",
        4 * 1024 * 1024,
        ge=1024,
        le=1 << 30,
    )
    node_timeout_s: float = variable(
        "SLURMGATE_OUTPUTS_NODE_TIMEOUT_S",
        "Seconds one node's collection may take (a dead node cannot hold up cleanup longer).",
        30.0,
        gt=0,
        le=3600,
    )
    node_root: str = variable(
        "SLURMGATE_NODE_OUTPUTS_ROOT",
        "Node-local directory under which a run's logs and results wait to be collected "
        "(default: the node's temporary directory, slurmgate-outputs).",
        "",
    )
