"""Serve the reconcile, release-lease and allocation deployments from one process (no work pool).

Run it wherever slurmgate is installed: `python -m slurmgate.deployments.serve [--interval 30]
[--scope default]`.
`--only reconcile` serves one of them; `--interval 0` serves without a schedule.

`--events` runs the admission loop (flows/admission_loop.py) in this process: reconcile ticks
here the moment `slurmgate webhook` posts a `github.workflow_job.queued` or `.completed` event
(coalesced: `--min-gap`, `--quiet`, `--max-delay`), and every `--interval` seconds without
one (0: events only); the deployment then has no server-side schedule (the loop is it).
`--triggers 10` instead adds the deployment triggers of prefect.yaml (debounced over 10 s, see
triggers.py), whose runs the runner starts as new processes, as a `prefect deploy` worker does.
With `--api-url URL --repo OWNER/NAME` (or `--org`) reconcile reads that scope directly, with the
token from $GITHUB_TOKEN, instead of the saved scope and policy blocks. With `--events`,
`--metrics-port 9464` serves the admission's Prometheus metrics (`admission/metrics.py`) on
`GET /metrics` of `--metrics-host` (127.0.0.1 by default).
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from slurmgate.admission.wakeups import WakeSettings, WakeSettingsError
from slurmgate.deployments.triggers import reconcile_triggers

RECONCILE_INTERVAL_S = 30
NAMES = ("reconcile", "release-lease", "allocation")


class InlineScope(NamedTuple):
    """A scope given on the command line; the flow reads the token from $GITHUB_TOKEN."""

    api_url: str
    repo: str | None = None
    org: str | None = None


def build_deployments(
    interval_s: float = RECONCILE_INTERVAL_S,
    scope_block: str = "default",
    policy_block: str | None = "default",
    *,
    only: str | None = None,
    reconcile_name: str = "reconcile",
    triggers_within_s: float | None = None,
    inline: InlineScope | None = None,
    schedule: bool = True,
) -> list[Any]:
    """The served deployments; reconcile runs at most once at a time (CANCEL_NEW). Without
    `schedule` reconcile gets no interval schedule (the admission loop ticks it instead)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from slurmgate.flows.allocation import allocation
    from slurmgate.flows.reconcile import reconcile
    from slurmgate.flows.release import release_lease

    single = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    parameters: dict[str, Any] = {"scope_block": scope_block, "policy_block": policy_block}
    if inline is not None:
        parameters = {"scope_block": None, "policy_block": None, **inline._asdict()}
    deployments = {
        "reconcile": reconcile.to_deployment(
            name=reconcile_name,
            interval=(interval_s or None) if schedule else None,
            parameters=parameters,
            triggers=reconcile_triggers(triggers_within_s) if triggers_within_s else None,
            concurrency_limit=single,
        ),
        "release-lease": release_lease.to_deployment(
            name="release-lease", parameters={"scope_block": scope_block}
        ),
        "allocation": allocation.to_deployment(name="allocation"),
    }
    return [deployments[only]] if only else list(deployments.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=RECONCILE_INTERVAL_S)
    parser.add_argument("--scope", default="default", help="name of the GitHub scope block")
    parser.add_argument(
        "--policy", default="default", help="name of the admission policy block ('' = env)"
    )
    parser.add_argument("--only", choices=NAMES, help="serve this deployment alone")
    parser.add_argument("--name", default="reconcile", help="name of the reconcile deployment")
    parser.add_argument("--triggers", type=float, metavar="SECONDS", help="event debounce window")
    parser.add_argument(
        "--events",
        action="store_true",
        help="tick reconcile in this process on GitHub job events (the admission loop)",
    )
    parser.add_argument("--min-gap", type=float, default=WakeSettings.min_gap_s, metavar="S")
    parser.add_argument("--quiet", type=float, default=WakeSettings.quiet_s, metavar="S")
    parser.add_argument("--max-delay", type=float, default=WakeSettings.max_delay_s, metavar="S")
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="with --events: serve the admission's Prometheus metrics on GET /metrics here",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of --metrics-port (127.0.0.1)"
    )
    parser.add_argument("--api-url", help="an inline scope instead of the blocks")
    parser.add_argument("--repo")
    parser.add_argument("--org")
    args = parser.parse_args(argv)
    if args.events and args.triggers is not None:
        parser.error("--events replaces --triggers: pass one of them")
    if args.events and args.only not in (None, "reconcile"):
        parser.error("--events ticks reconcile: drop --only or pass --only reconcile")
    if args.metrics_port is not None and not args.events:
        parser.error(
            "--metrics-port needs --events: only then do the ticks run in this process (under "
            "a worker, set SLURMGATE_METRICS_TEXTFILE for node_exporter's textfile collector)"
        )
    wake = None
    if args.events:
        try:
            wake = WakeSettings(
                interval_s=args.interval or None,
                min_gap_s=args.min_gap,
                quiet_s=args.quiet,
                max_delay_s=args.max_delay,
            )
        except WakeSettingsError as exc:
            parser.error(str(exc))
    inline = InlineScope(args.api_url, args.repo, args.org) if args.api_url else None
    # our commands' Prefect defaults (telemetry off), then one line naming the API served to
    from slurmgate.errors import ExternalError
    from slurmgate.flows.prefect_api import prefect_defaults, use_prefect_api

    prefect_defaults()
    try:
        use_prefect_api()
    except ExternalError as exc:
        parser.exit(1, f"error: {exc}\n")
    from prefect import serve

    deployments = build_deployments(
        args.interval,
        args.scope,
        args.policy or None,
        only=args.only,
        reconcile_name=args.name,
        triggers_within_s=args.triggers,
        inline=inline,
        schedule=wake is None,
    )
    if wake is None:
        serve(*deployments)
        return
    import asyncio

    from slurmgate.flows.admission_loop import serve_with_admission_loop
    from slurmgate.flows.reconcile import reconcile

    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        from slurmgate.admission.metrics import METRICS

        try:
            start_http_server(args.metrics_port, args.metrics_host, registry=METRICS.registry)
        except OSError as exc:
            parser.exit(1, f"error: --metrics-port {args.metrics_port}: {exc.strerror}\n")
        print(f"metrics on http://{args.metrics_host}:{args.metrics_port}/metrics")
    every = f"every {wake.interval_s:g} s and " if wake.interval_s else ""
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    print(f"serving {names}; reconcile ticks here {every}on GitHub job events (Ctrl-C stops)")
    asyncio.run(serve_with_admission_loop(deployments, args.name, reconcile, wake))


if __name__ == "__main__":
    main()
