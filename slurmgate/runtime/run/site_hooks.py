"""The site's prolog and epilog around a run, each under its guard."""

from __future__ import annotations

from slurmgate.runtime.hooks import HookInvocation, HookOutcome
from slurmgate.runtime.run.state import RunFailed, RunState


class HookPhases(RunState):
    """The spec's site hooks: the prolog before the preflight, the epilog after cleanup."""

    def run_hook(self, name: str, extra: dict[str, str] | None = None) -> HookOutcome | None:
        """Run the spec's hook `name` on this host under its guard (None when unset)."""
        hook = self.spec.hooks.named().get(name)
        if hook is None:
            return None
        named = {"SLURMGATE_HOOK": name, "SLURMGATE_RUN_DIR": str(self.run_dir)}
        if self.job_id:
            named["SLURM_JOB_ID"] = self.job_id
        if self.layout:
            named["SLURMGATE_HOSTS"] = ",".join(self.layout.hosts)
            named["SLURMGATE_CLIENT_HOST"] = self.layout.client_host
        env = self._base_env({**named, **(extra or {}), **self.credentials.hook_env[name]})
        invocation = HookInvocation(
            name, self.run_dir, list(hook.commands), env, hook.timeout_s,
            secrets=sorted(self.credentials.secret_values),
        )  # fmt: skip
        self.log(f"hook {name}: {len(hook.commands)} command(s), {hook.timeout_s:g} s at most")
        try:
            self._hook_runner(invocation)
        except Exception as exc:  # the runner itself failed: the outcome file says the rest
            self.log(f"hook {name}: its runner failed: {type(exc).__name__}: {exc}")
        outcome = self.hooks[name] = invocation.outcome()
        self.save()
        self.log(f"hook {name} {outcome.describe()}; its output: {invocation.log_path}")
        if not outcome.ok and name == "prolog":
            raise RunFailed(
                "prolog",
                f"the prolog {outcome.describe()}; nothing was launched. Its output "
                f"({invocation.log_path}) ends:\n{self.redact(invocation.log_tail())}",
            )
        return outcome

    def prolog(self) -> None:
        """The site's prolog, once the hosts are known and before the preflight: a failure
        stops the run before anything is launched."""
        if "prolog" in self.spec.hooks.named():
            self._enter("prolog")
            self.run_hook("prolog")

    def epilog(self) -> None:
        """The site's epilog, after cleanup: its failure is reported, never raised."""
        if "epilog" not in self.spec.hooks.named() or "epilog" in self.hooks:
            return
        outcome = "failed" if self.error else "succeeded"
        if self._cleanup_report is not None and not self._cleanup_report.complete:
            outcome = "cleanup-failed"
        self.run_hook("epilog", {"SLURMGATE_RUN_OUTCOME": outcome})
