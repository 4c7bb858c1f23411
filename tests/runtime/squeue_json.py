"""`squeue --all --json` as Slurm prints it, and `squeue`/`scancel` stand-ins that print it.

Two shapes of the same listing:

- Slurm 22.05's, the bundled cluster's: squeue dumps each job as the openapi/v0.0.38 plugin
  does (`dump_job_info`): a state as one word (`job_state_string`: a flag such as COMPLETING
  stands for the whole state), times and counts as plain numbers or null, an unset string as
  null, and json-c's escaped slashes.
- The data parser's, from Slurm 23.11 on (data_parser/v0.0.40 and later, 24.05's v0.0.41 here):
  a state as a list of words (its base state, then its flags), most numbers as
  `{"set": ..., "infinite": ..., "number": ...}`, and a meta block naming the command.

The fields are those Slurm prints for a `salloc --no-shell` job on the bundled cluster.
`FakeSlurm` puts executables named `squeue` and `scancel` first on PATH: real subprocesses that
print what a test gives them and log every call, so the code under test runs its commands as
it does against Slurm.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUBMITTED = 1_796_000_000


def _no_val(number: int | float | None, *, infinite: bool = False) -> dict[str, Any]:
    """The data parser's number with flags."""
    if infinite:
        return {"set": False, "infinite": True, "number": 0}
    if number is None:
        return {"set": False, "infinite": False, "number": 0}
    return {"set": True, "infinite": False, "number": number}


def job_22_05(
    job_id: int,
    name: str | None,
    user: str | None,
    uid: int,
    *,
    state: str = "RUNNING",
    comment: str | None = None,
    nodes: str = "node1",
) -> dict[str, Any]:
    """One job as Slurm 22.05's `squeue --json` prints it."""
    pending = state == "PENDING"
    start = 0 if pending else SUBMITTED + 2
    job = {
        "account": None,
        "accrue_time": SUBMITTED,
        "admin_comment": None,
        "array_job_id": 0,
        "array_task_id": None,
        "array_max_tasks": 0,
        "array_task_string": None,
        "association_id": 0,
        "batch_features": None,
        "batch_flag": False,
        "batch_host": None if pending else nodes,
        "flags": ["JOB_CPUS_SET", "JOB_WAS_RUNNING"],
        "burst_buffer": None,
        "burst_buffer_state": None,
        "cluster": "slurmgate",
        "cluster_features": None,
        "command": None,
        "comment": comment,
        "contiguous": False,
        "core_spec": None,
        "thread_spec": None,
        "cores_per_socket": None,
        "billable_tres": 1.0,
        "cpus_per_task": None,
        "cpu_frequency_minimum": None,
        "cpu_frequency_maximum": None,
        "cpu_frequency_governor": None,
        "cpus_per_tres": None,
        "deadline": 0,
        "delay_boot": 0,
        "dependency": None,
        "derived_exit_code": 0,
        "eligible_time": SUBMITTED,
        "end_time": 0 if pending else SUBMITTED + 2 + 3600,
        "excluded_nodes": None,
        "exit_code": 0,
        "features": None,
        "federation_origin": None,
        "federation_siblings_active": None,
        "federation_siblings_viable": None,
        "gres_detail": [] if pending else ["gpu:8(IDX:0-7)"],
        "group_id": uid,
        "job_id": job_id,
        "job_resources": {
            "nodes": nodes,
            "allocated_cores": 1,
            "allocated_hosts": 1,
            "allocated_nodes": [
                {
                    "sockets": {"0": {"cores": {"0": "allocated"}}},
                    "nodename": nodes,
                    "cpus_used": 0,
                    "memory_used": 0,
                    "memory_allocated": 0,
                }
            ],
        },
        "job_state": state,
        "last_sched_evaluation": SUBMITTED + 2,
        "licenses": None,
        "max_cpus": 0,
        "max_nodes": 0,
        "mcs_label": None,
        "memory_per_tres": None,
        "name": name,
        "nodes": None if pending else nodes,
        "nice": None,
        "tasks_per_core": None,
        "tasks_per_node": 0,
        "tasks_per_socket": None,
        "tasks_per_board": 0,
        "cpus": 1,
        "node_count": 1,
        "tasks": 1,
        "het_job_id": 0,
        "het_job_id_set": None,
        "het_job_offset": 0,
        "partition": "debug",
        "memory_per_node": None,
        "memory_per_cpu": None,
        "minimum_cpus_per_node": 1,
        "minimum_tmp_disk_per_node": 0,
        "preempt_time": 0,
        "pre_sus_time": 0,
        "priority": 4294901759,
        "profile": None,
        "qos": None,
        "reboot": False,
        "required_nodes": None,
        "requeue": False,
        "resize_time": 0,
        "restart_cnt": 0,
        "resv_name": None,
        "shared": None,
        "show_flags": ["SHOW_ALL", "SHOW_DETAIL", "SHOW_LOCAL"],
        "sockets_per_board": 0,
        "sockets_per_node": None,
        "start_time": start,
        "state_description": None,
        "state_reason": "Resources" if pending else "None",
        "standard_error": None,
        "standard_input": None,
        "standard_output": None,
        "submit_time": SUBMITTED,
        "suspend_time": 0,
        "system_comment": None,
        "time_limit": None,
        "time_minimum": 0,
        "threads_per_core": None,
        "tres_bind": None,
        "tres_freq": None,
        "tres_per_job": None,
        "tres_per_node": "gres:gpu:8",
        "tres_per_socket": None,
        "tres_per_task": None,
        "tres_req_str": "cpu=1,node=1,billing=1",
        "tres_alloc_str": None if pending else "cpu=1,node=1,billing=1",
        "user_id": uid,
        "user_name": user,
        "wckey": None,
        "current_working_directory": "/tmp",
    }
    if pending:
        del job["job_resources"]  # Slurm prints it only once the job holds resources
    return job


def listing_22_05(*jobs: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": {
            "plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"},
            "Slurm": {"version": {"major": 22, "micro": 8, "minor": 5}, "release": "22.05.8"},
        },
        "errors": [],
        "jobs": list(jobs),
    }


def text_22_05(document: dict[str, Any]) -> str:
    """The listing as 22.05's serializer writes it: indented, slashes escaped (json-c)."""
    return json.dumps(document, indent=3).replace("/", "\\/") + "\n"


def job_24_05(
    job_id: int,
    name: str,
    user: str,
    uid: int,
    *,
    state: Sequence[str] = ("RUNNING",),
    comment: str = "",
    nodes: str = "node1",
) -> dict[str, Any]:
    """One job as the data parser (v0.0.41, Slurm 24.05) prints it in `squeue --json`."""
    pending = "PENDING" in state
    job = {
        "account": "",
        "accrue_time": _no_val(SUBMITTED),
        "admin_comment": "",
        "allocating_node": "login1",
        "array_job_id": _no_val(0),
        "array_task_id": _no_val(None),
        "array_max_tasks": _no_val(0),
        "array_task_string": "",
        "association_id": 0,
        "batch_features": "",
        "batch_flag": False,
        "batch_host": "" if pending else nodes,
        "flags": ["EXACT_CPU_COUNT_REQUESTED", "JOB_WAS_RUNNING", "PARTITION_ASSIGNED"],
        "burst_buffer": "",
        "burst_buffer_state": "",
        "cluster": "slurmgate",
        "cluster_features": "",
        "command": "",
        "comment": comment,
        "container": "",
        "container_id": "",
        "contiguous": False,
        "core_spec": 0,
        "thread_spec": 32766,
        "cores_per_socket": _no_val(None),
        "billable_tres": _no_val(1.0),
        "cpus_per_task": _no_val(None),
        "cpu_frequency_minimum": _no_val(None),
        "cpu_frequency_maximum": _no_val(None),
        "cpu_frequency_governor": _no_val(None),
        "cpus_per_tres": "",
        "cron": "",
        "deadline": _no_val(0),
        "delay_boot": _no_val(0),
        "dependency": "",
        "derived_exit_code": {
            "status": ["SUCCESS"],
            "return_code": _no_val(0),
            "signal": {"id": _no_val(None), "name": ""},
        },
        "eligible_time": _no_val(SUBMITTED),
        "end_time": _no_val(0 if pending else SUBMITTED + 2 + 3600),
        "excluded_nodes": "",
        "exit_code": {
            "status": ["SUCCESS"],
            "return_code": _no_val(0),
            "signal": {"id": _no_val(None), "name": ""},
        },
        "extra": "",
        "failed_node": "",
        "features": "",
        "federation_origin": "",
        "federation_siblings_active": "",
        "federation_siblings_viable": "",
        "gres_detail": [] if pending else ["gpu:8(IDX:0-7)"],
        "group_id": uid,
        "group_name": user,
        "het_job_id": _no_val(0),
        "het_job_id_set": "",
        "het_job_offset": _no_val(0),
        "job_id": job_id,
        "job_resources": {
            "select_type": ["CORE"],
            "nodes": {
                "count": 1,
                "select_type": ["AVAILABLE", "ONE_ROW"],
                "list": nodes,
                "whole": False,
                "allocation": [
                    {
                        "index": 0,
                        "name": nodes,
                        "cpus": {"count": 1, "used": 0},
                        "memory": {"used": 0, "allocated": 0},
                        "sockets": [{"index": 0, "cores": [{"index": 0, "status": ["ALLOCATED"]}]}],
                    }
                ],
            },
            "cpus": 1,
            "threads_per_core": _no_val(1),
        },
        "job_size_str": [],
        "job_state": list(state),
        "last_sched_evaluation": _no_val(SUBMITTED + 2),
        "licenses": "",
        "mail_type": [],
        "mail_user": user,
        "max_cpus": _no_val(0),
        "max_nodes": _no_val(0),
        "mcs_label": "",
        "memory_per_tres": "",
        "name": name,
        "network": "",
        "nodes": "" if pending else nodes,
        "nice": 0,
        "tasks_per_core": _no_val(None, infinite=True),
        "tasks_per_tres": _no_val(0),
        "tasks_per_node": _no_val(0),
        "tasks_per_socket": _no_val(None, infinite=True),
        "tasks_per_board": _no_val(0),
        "cpus": _no_val(1),
        "node_count": _no_val(1),
        "tasks": _no_val(1),
        "partition": "debug",
        "prefer": "",
        "memory_per_cpu": _no_val(None),
        "memory_per_node": _no_val(0),
        "minimum_cpus_per_node": _no_val(1),
        "minimum_tmp_disk_per_node": _no_val(0),
        "power": {"flags": []},
        "preempt_time": _no_val(0),
        "preemptable_time": _no_val(0),
        "pre_sus_time": _no_val(0),
        "hold": False,
        "priority": _no_val(1),
        "profile": ["NOT_SET"],
        "qos": "",
        "reboot": False,
        "required_nodes": "",
        "minimum_switches": 0,
        "requeue": False,
        "resize_time": _no_val(0),
        "restart_cnt": 0,
        "resv_name": "",
        "scheduled_nodes": "",
        "selinux_context": "",
        "shared": [],
        "exclusive": [],
        "oversubscribe": False,
        "show_flags": ["ALL", "DETAIL", "LOCAL"],
        "sockets_per_board": 0,
        "sockets_per_node": _no_val(None),
        "start_time": _no_val(0 if pending else SUBMITTED + 2),
        "state_description": "",
        "state_reason": "Resources" if pending else "None",
        "standard_error": "",
        "standard_input": "",
        "standard_output": "",
        "submit_time": _no_val(SUBMITTED),
        "suspend_time": _no_val(0),
        "system_comment": "",
        "time_limit": _no_val(None, infinite=True),
        "time_minimum": _no_val(0),
        "threads_per_core": _no_val(None),
        "tres_bind": "",
        "tres_freq": "",
        "tres_per_job": "",
        "tres_per_node": "gres/gpu:8",
        "tres_per_socket": "",
        "tres_per_task": "",
        "tres_req_str": "cpu=1,node=1,billing=1",
        "tres_alloc_str": "" if pending else "cpu=1,node=1,billing=1",
        "user_id": uid,
        "user_name": user,
        "maximum_switch_wait_time": 0,
        "wckey": "",
        "current_working_directory": "/tmp",
    }
    if pending:
        del job["job_resources"]
    return job


def listing_24_05(*jobs: dict[str, Any]) -> dict[str, Any]:
    return {
        "jobs": list(jobs),
        "last_backfill": _no_val(SUBMITTED + 30),
        "last_update": _no_val(SUBMITTED + 31),
        "meta": {
            "plugin": {
                "type": "",
                "name": "",
                "data_parser": "data_parser/v0.0.41",
                "accounting_storage": "accounting_storage/slurmdbd",
            },
            "client": {"source": "/dev/pts/0", "user": "root", "group": "root"},
            "command": ["squeue", "--all", "--json"],
            "slurm": {
                "version": {"major": "24", "micro": "2", "minor": "05"},
                "release": "24.05.2",
                "cluster": "slurmgate",
            },
        },
        "errors": [],
        "warnings": [],
    }


_SQUEUE = """\
import json, os, sys
state = {state!r}
with open(os.path.join(state, "calls.log"), "a") as fh:
    fh.write(json.dumps(["squeue", *sys.argv[1:]]) + "\\n")
name = "squeue.json" if "--json" in sys.argv else "squeue.steps" if "-s" in sys.argv else None
pad = os.path.join(state, "squeue.pad")
if name == "squeue.json" and os.path.exists(pad):
    left = int(open(pad).read())
    while left > 0:
        sys.stdout.write(" " * min(left, 1 << 20))
        left -= 1 << 20
if name and os.path.exists(os.path.join(state, name)):
    sys.stdout.write(open(os.path.join(state, name)).read())
"""

_SCANCEL = """\
import json, os, sys
state = {state!r}
with open(os.path.join(state, "calls.log"), "a") as fh:
    fh.write(json.dumps(["scancel", *sys.argv[1:]]) + "\\n")
"""


class FakeSlurm:
    """`squeue` and `scancel` for a test: `squeue --json` prints `listing()`'s text, `squeue -s`
    prints `steps()`'s, `scancel` succeeds; `calls()` is every command line they were run with.
    Install with `install(monkeypatch)`."""

    def __init__(self, root: Path) -> None:
        self.state = root / "state"
        self.bin = root / "bin"
        self.state.mkdir(parents=True)
        self.bin.mkdir()
        for name, body in (("squeue", _SQUEUE), ("scancel", _SCANCEL)):
            path = self.bin / name
            path.write_text(f"#!{sys.executable}\n" + body.format(state=str(self.state)))
            path.chmod(0o755)
        self.conf = root / "slurm.conf"
        self.conf.write_text("")

    def env(self) -> dict[str, str]:
        """What the test's environment needs: these commands first on PATH, and a SLURM_CONF
        that exists (a missing one is refused before any command runs)."""
        return {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "SLURM_CONF": str(self.conf),
        }

    def listing(self, document: dict[str, Any] | str, *, pad: int = 0) -> None:
        """What `squeue --json` prints next: a document (as JSON) or text as it is, after
        `pad` spaces."""
        text = document if isinstance(document, str) else json.dumps(document)
        (self.state / "squeue.json").write_text(text)
        if pad:
            (self.state / "squeue.pad").write_text(str(pad))

    def steps(self, text: str) -> None:
        (self.state / "squeue.steps").write_text(text)

    def calls(self) -> list[list[str]]:
        log = self.state / "calls.log"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    def cancels(self) -> list[list[str]]:
        return [call[1:] for call in self.calls() if call[0] == "scancel"]
