"""Serve reconcile with the event trigger against $PREFECT_API_URL (run as a subprocess).

Usage: python serve_reconcile.py NAME EMULATOR_URL REPO [WITHIN_S] [INTERVAL_S]
WITHIN_S below 0 serves without the triggers; INTERVAL_S 0 (the default) serves without a
schedule, so every run comes from a trigger.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "deployments")]


def main(argv: list[str]) -> None:
    from prefect import serve
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from triggers import reconcile_triggers

    from flows.reconcile import reconcile

    name, api_url, repo = argv[:3]
    within = float(argv[3]) if len(argv) > 3 else 10.0
    interval = float(argv[4]) if len(argv) > 4 else 0.0
    deployment = reconcile.to_deployment(
        name=name,
        parameters={"scope_block": None, "policy_block": None, "api_url": api_url, "repo": repo},
        triggers=reconcile_triggers(within) if within >= 0 else None,
        interval=interval or None,
        concurrency_limit=ConcurrencyLimitConfig(
            limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
        ),
    )
    print(f"serving reconcile/{name}", flush=True)
    serve(deployment, print_starting_message=False)


if __name__ == "__main__":
    main(sys.argv[1:])
