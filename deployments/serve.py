"""Serve the reconcile, release-lease and allocation deployments from one process (no work pool).

Run from the repository root: `python deployments/serve.py [--interval 30] [--scope default]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# the flows live in the repository's top-level packages; make them importable from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RECONCILE_INTERVAL_S = 30


def build_deployments(
    interval_s: float = RECONCILE_INTERVAL_S,
    scope_block: str = "default",
    policy_block: str | None = "default",
) -> list[Any]:
    """The three served deployments; reconcile runs at most once at a time (CANCEL_NEW)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from flows.reconcile import reconcile
    from flows.release import release_lease

    single = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    deployments = [
        reconcile.to_deployment(
            name="reconcile",
            interval=interval_s,
            parameters={"scope_block": scope_block, "policy_block": policy_block},
            concurrency_limit=single,
        ),
        release_lease.to_deployment(name="release-lease", parameters={"scope_block": scope_block}),
    ]
    try:
        from flows.allocation import allocation  # built by the allocation runtime
    except ImportError as exc:
        print(f"serve: allocation flow not available ({exc}); serving the others", file=sys.stderr)
    else:
        deployments.append(allocation.to_deployment(name="allocation"))
    return deployments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=RECONCILE_INTERVAL_S)
    parser.add_argument("--scope", default="default", help="name of the GitHub scope block")
    parser.add_argument("--policy", default="default", help="name of the admission policy block")
    args = parser.parse_args(argv)
    from prefect import serve

    serve(*build_deployments(args.interval, args.scope, args.policy))


if __name__ == "__main__":
    main()
