"""The site's prolog and epilog around a run, each under its guard."""

from __future__ import annotations

from slurmgate.runtime.hooks import HookInvocation, HookOutcome
from slurmgate.runtime.run.state import RunContext, RunFailed


def run_hook(ctx: RunContext, name: str, extra: dict[str, str] | None = None) -> HookOutcome | None:
    """Run the spec's hook `name` on this host under its guard (None when unset)."""
    hook = ctx.spec.hooks.named().get(name)
    if hook is None:
        return None
    named = {"SLURMGATE_HOOK": name, "SLURMGATE_RUN_DIR": str(ctx.run_dir)}
    if ctx.job_id:
        named["SLURM_JOB_ID"] = ctx.job_id
    if ctx.layout:
        named["SLURMGATE_HOSTS"] = ",".join(ctx.layout.hosts)
        named["SLURMGATE_CLIENT_HOST"] = ctx.layout.client_host
    env = ctx.base_env({**named, **(extra or {}), **ctx.credentials.hook_env[name]})
    invocation = HookInvocation(
        name, ctx.run_dir, list(hook.commands), env, hook.timeout_s,
        secrets=sorted(ctx.credentials.secret_values),
    )  # fmt: skip
    ctx.log(f"hook {name}: {len(hook.commands)} command(s), {hook.timeout_s:g} s at most")
    try:
        ctx.hook_runner(invocation)
    except Exception as exc:  # the runner itself failed: the outcome file says the rest
        ctx.log(f"hook {name}: its runner failed: {type(exc).__name__}: {exc}")
    outcome = ctx.hooks[name] = invocation.outcome()
    ctx.save()
    ctx.log(f"hook {name} {outcome.describe()}; its output: {invocation.log_path}")
    if not outcome.ok and name == "prolog":
        raise RunFailed(
            "prolog",
            f"the prolog {outcome.describe()}; nothing was launched. Its output "
            f"({invocation.log_path}) ends:\n{ctx.redact(invocation.log_tail())}",
        )
    return outcome


def prolog(ctx: RunContext) -> None:
    """The site's prolog, once the hosts are known and before the preflight: a failure
    stops the run before anything is launched."""
    if "prolog" in ctx.spec.hooks.named():
        ctx.enter("prolog")
        run_hook(ctx, "prolog")


def epilog(ctx: RunContext) -> None:
    """The site's epilog, after cleanup: its failure is reported, never raised."""
    if "epilog" not in ctx.spec.hooks.named() or "epilog" in ctx.hooks:
        return
    outcome = "failed" if ctx.error else "succeeded"
    if ctx.cleanup_report is not None and not ctx.cleanup_report.complete:
        outcome = "cleanup-failed"
    run_hook(ctx, "epilog", {"SLURMGATE_RUN_OUTCOME": outcome})
