"""The one door from the command line into the Prefect layer (`slurmgate.flows`), on demand.

The core never imports prefect, so that node workers and endpoints start fast; only the commands
that run a flow come through here, and only when they run. Importing it sets Prefect's defaults
for our commands (telemetry off unless the user turned it on) before anything imports Prefect.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any


def _prefect_settings() -> None:
    from slurmgate.flows.prefect_api import prefect_defaults

    prefect_defaults()


# Importing this module means a flow is about to run: whatever imports prefect next sees them.
_prefect_settings()


def prefect_yaml() -> Path:
    """The prefect.yaml installed with the deployments (`slurmgate.deployments`)."""
    from slurmgate import deployments

    return Path(deployments.__file__).with_name("prefect.yaml")


def use_prefect_api() -> None:
    """Say on stderr which Prefect API this command's flow runs go to (`flows/prefect_api.py`)."""
    from slurmgate.flows.prefect_api import use_prefect_api as announce

    announce()


if TYPE_CHECKING:
    from slurmgate.github.scope import GitHubScope
    from slurmgate.runtime.spec.allocation import AllocationSpec
    from slurmgate.testbed.demo import DemoOptions


def run_reconcile_tick(scope: GitHubScope) -> dict[str, Any]:
    """One tick of the `reconcile` flow on an inline scope (token from $GITHUB_TOKEN)."""
    _prefect_settings()
    use_prefect_api()
    from slurmgate.flows.reconcile import reconcile

    return asyncio.run(
        reconcile(
            scope_block=None,
            api_url=scope.api_url,
            repo=scope.repo,
            org=scope.org,
            repos=list(scope.repos),
            all_repos=scope.all_repos,
        )
    )


def run_allocation(
    spec: AllocationSpec, runs_dir: str | None, outputs_bucket: str | None = None
) -> dict[str, Any]:
    """The `allocation` flow, in this process; raises when the run or its cleanup fails."""
    _prefect_settings()
    use_prefect_api()
    from slurmgate.flows.allocation import allocation

    return allocation(spec=spec, runs_dir=runs_dir, outputs_bucket=outputs_bucket)


def run_demo(options: DemoOptions) -> int:
    """The demo driver; its exit code."""
    _prefect_settings()
    # The board is the demo's output: flow logs reach the console only from WARNING up (they
    # all still reach the Prefect server and its UI).
    for handler in ("CONSOLE", "CONSOLE_FLOW_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_HANDLERS_{handler}_LEVEL", "WARNING")
    from slurmgate.flows.demo import run_demo as demo

    return demo(options)


def configured_prefect_api() -> tuple[str, str | None] | None:
    """The Prefect API the user configured (PREFECT_API_URL from the environment or the active
    profile) with its auth string, or None: flows would then run on a temporary server."""
    _prefect_settings()
    from slurmgate.flows.blocks_setup import configured_prefect_api as configured

    return configured()


def save_slurmgate_blocks(name: str, scope: dict[str, Any], policy: dict[str, Any]) -> None:
    """Register slurmgate's block types and save the scope and policy blocks as `name`
    (replacing blocks of that name), on the configured Prefect API."""
    _prefect_settings()
    from slurmgate.flows.blocks_setup import save_slurmgate_blocks as save

    save(name, scope, policy)


def set_cordon(name: str, pool: str, reason: str | None) -> dict[str, str]:
    """Cordon (or, with `reason` None, reopen) a pool in the saved policy block `name`."""
    _prefect_settings()
    from slurmgate.flows.blocks_setup import set_cordon as set_it

    return set_it(name, pool, reason)
