"""Dynamo's file discovery: the run's directory in a shared one, proved shared, then removed."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from slurmgate.runtime.run.state import RunContext
from slurmgate.runtime.spec.deployment import DeploymentSpec

TOKEN_FILE = "slurmgate-preflight-token"


def kv_dir(ctx: RunContext, dspec: DeploymentSpec) -> Path | None:
    """DYN_FILE_KV of a deployment whose Dynamo frontend has `discovery: file`, else None:
    a directory of this run's in `discovery_dir`, or in the run's own directory."""
    f = dspec.frontend
    if f is None or f.type != "dynamo" or f.discovery != "file":
        return None
    if f.discovery_dir is None:
        return (ctx.run_dir / f"discovery-{dspec.name}").resolve()
    return Path(f.discovery_dir) / f"slurmgate-{ctx.run_id}-{dspec.name}"


def env(ctx: RunContext, dspec: DeploymentSpec) -> dict[str, str]:
    """What every Dynamo process of the deployment adds for file discovery."""
    where = kv_dir(ctx, dspec)
    return {} if where is None else {"DYN_FILE_KV": str(where)}


def prepare(ctx: RunContext, dspec: DeploymentSpec) -> dict[str, str]:
    """Make the directory (once) with a fresh token in it: {token file: token}, which
    preflight reads back on every node, so a directory the nodes do not share fails the run
    there, before any worker registers where the frontend cannot look."""
    where = kv_dir(ctx, dspec)
    if where is None:
        return {}
    token_file = where / TOKEN_FILE
    if not token_file.is_file():
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        token_file.write_text(secrets.token_hex(16))
    return {str(token_file): token_file.read_text()}


def remove(ctx: RunContext) -> list[str]:
    """Remove every deployment's directory (its records too: a killed worker's stay behind);
    the actions taken, for the cleanup report."""
    done = []
    for dspec in ctx.spec.deployments:
        where = kv_dir(ctx, dspec)
        if where is not None and os.path.lexists(where):
            shutil.rmtree(where, ignore_errors=True)
            done.append(f"removed {dspec.name}'s discovery directory {where}")
    return done
