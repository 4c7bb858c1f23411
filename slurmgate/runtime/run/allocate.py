"""Allocate and resolve: attach to or salloc the job, then bind the layout to its hosts."""

from __future__ import annotations

import time
from typing import Any

from slurmgate.runtime.engines import layout as layout_mod
from slurmgate.runtime.ledger import heartbeat
from slurmgate.runtime.ledger.comment import ProcessIdentity, job_comment
from slurmgate.runtime.run.state import RunFailed, RunState
from slurmgate.slurm import commands as slurm


class AllocatePhase(RunState):
    """The job and its hosts."""

    def allocate(self) -> str:
        """Attach to SLURM_JOB_ID, or salloc one that this run owns and always cancels."""
        self._enter("allocate")
        t0 = time.monotonic()
        attached = slurm.current_job_id()
        if attached:
            self.job_id = attached
            self.log(f"decision: attach to allocation {attached} (SLURM_JOB_ID is set)")
        else:
            site = self.spec.slurm
            options = "".join(
                f", {name} {value}"
                for name, value in (
                    ("partition", site.partition),
                    ("account", site.account),
                    ("qos", site.qos),
                    ("reservation", site.reservation),
                    ("constraint", site.constraint),
                )
                if value
            )
            if self.excluded_nodes:
                options += f", excluding {','.join(self.excluded_nodes)}"
            try:
                interval_s = heartbeat.interval_from_env()
            except ValueError as exc:
                raise RunFailed("allocate", str(exc)) from None
            self.log(
                f"decision: no SLURM_JOB_ID, salloc {self.plan.total_nodes} node(s) "
                f"with gpu:{self.spec.gpus_per_node}{options}"
            )
            self.owned_allocation = True  # before the call: a late grant is still ours to cancel
            self.save()
            # wall-clock instants, so a caller can line the grant up with events outside the
            # run (the CI job's dispatch to its runner, in the demo)
            self.timings.marks["salloc_asked_at_epoch"] = time.time()
            self.job_id = slurm.salloc_no_shell(
                **self.salloc_request(), timeout=self.allocate_timeout_s
            )
            self.timings.marks["allocated_at_epoch"] = time.time()
            # a reaper on another host sees this run alive only through the comment's beat
            self._heartbeat = heartbeat.Heartbeat(
                self.job_id,
                self.run_id,
                ProcessIdentity.current(),
                interval_s=interval_s,
                warn=self.log,
            ).start()
        self.supervisor.job_id = self.job_id
        self.timings.mark("allocated", t0)
        self.save()
        return self.job_id

    def salloc_request(self) -> dict[str, Any]:
        """What `allocate` asks Slurm for when the run owns its allocation (`salloc_argv`)."""
        return {
            "nodes": self.plan.total_nodes,
            "job_name": self.run_id,
            "gpus_per_node": self.spec.gpus_per_node,
            "time_limit": self.spec.time_limit,
            "partition": self.spec.slurm.partition,
            "account": self.spec.slurm.account,
            "qos": self.spec.slurm.qos,
            "reservation": self.spec.slurm.reservation,
            "constraint": self.spec.slurm.constraint,
            "exclude": list(self.excluded_nodes),
            # who controls the job, for a reaper that cannot read this run's record
            "comment": job_comment(self.run_id, ProcessIdentity.current(), int(time.time())),
        }

    def resolve(self) -> layout_mod.Layout:
        """Hosts in allocation order → a bound layout; the node count must match the plan."""
        self._enter("resolve")
        assert self.job_id
        info = slurm.show_job(self.job_id)
        if info is None or not info.nodelist:
            raise RunFailed("resolve", f"allocation {self.job_id} is not running")
        hosts = slurm.show_hostnames(info.nodelist)
        addresses = slurm.node_addresses(hosts)
        try:
            self.layout = layout_mod.bind(self.plan, hosts, addresses)
        except layout_mod.LayoutError as exc:
            raise RunFailed("resolve", str(exc)) from None
        for row in layout_mod.describe(self.layout):
            self.log(
                "decision: lane {deployment} replica {replica} rank {rank} on {node} "
                "gpus {gpus} port {port} rendezvous {rendezvous} delay {delay_s}s".format(**row)
            )
        self.log(f"decision: client and endpoints on {self.layout.client_host}")
        self.save()
        return self.layout
