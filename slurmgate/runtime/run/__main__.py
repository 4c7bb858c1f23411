"""`python -m slurmgate.runtime.run`: run a spec without Prefect, or reap what killed runs left."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from slurmgate.errors import InputError
from slurmgate.runtime.run.allocation_run import AllocationRun
from slurmgate.runtime.run.state import RunFailed
from slurmgate.runtime.run.supervisor import CleanupFailed, StepFailed
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.slurm import commands as slurm


class Terminated(BaseException):
    """SIGTERM/SIGINT reached the controller."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slurmgate.runtime.run",
        description="Run an allocation spec without Prefect, or reap what killed runs left.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run SPEC: every phase, then cleanup")
    run.add_argument("spec", type=Path, help="the allocation spec (YAML)")
    reap = commands.add_parser("reap", help="cancel the leftovers of runs whose controller died")
    for sub in (run, reap):
        sub.add_argument("--runs-dir", type=Path, default=None, help="run directories")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m slurmgate.runtime.run run SPEC [--runs-dir D]`: the run without Prefect."""
    from slurmgate.runtime.ledger.reaper import reap_stale_runs
    from slurmgate.runtime.ledger.records import load_records
    from slurmgate.runtime.spec.errors import SpecError

    args = _parser().parse_args(argv)
    if args.command == "reap":
        tally = reap_stale_runs(load_records(args.runs_dir), wait_out_backoff=False, info=print)
        if tally.slurm_error:
            print(f"reap stopped, Slurm did not answer: {tally.slurm_error}", file=sys.stderr)
            return 1
        return 0
    try:
        spec = AllocationSpec.from_yaml(args.spec)
    except SpecError as exc:
        print(f"invalid spec:\n{exc}", file=sys.stderr)
        return 2
    try:
        run = AllocationRun(spec, runs_root=args.runs_dir)
    except InputError as exc:  # a secret reference this host cannot resolve
        print(f"invalid spec:\n{exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, _raise_terminated)
    print(f"run {run.run_id}: record {run.record_path}", file=sys.stderr, flush=True)
    try:
        run.run()
    except Terminated as exc:
        print(f"run {run.run_id} terminated by {exc}; cleanup done", file=sys.stderr)
        return 128 + exc.signum
    except (RunFailed, StepFailed, CleanupFailed, slurm.SlurmError) as exc:
        print(f"run {run.run_id} failed: {exc}", file=sys.stderr)
        _say_outputs(run)
        return 1
    print(f"run {run.run_id} succeeded", file=sys.stderr)
    _say_outputs(run)
    return 0


def _say_outputs(run: AllocationRun) -> None:
    """Where cleanup collected every node's logs and results (runtime/run/outputs.py)."""
    if run.context.outputs:
        print(f"run {run.run_id}: logs and results in {run.context.outputs_dir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
