"""A synchronous client of the emulator's `/_emulator/` admin API: for commands, tests, benches."""

from __future__ import annotations

import time
from typing import Any, TypedDict, Unpack

import httpx

from slurmgate.errors import ExternalError

DEFAULT_PORT = 8787
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
"""Where `slurmgate emulator` listens unless told otherwise."""


class EmulatorAdminError(ExternalError):
    """The emulator refused an admin call, or could not be reached (`status` None)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


class JobExtras(TypedDict, total=False):
    """What a queued job may carry besides its labels and duration."""

    name: str | None
    run_id: int | None
    pull_request: int | None
    repo: str | None


class EmulatorAdmin:
    """A small synchronous client for the `/_emulator/` admin API."""

    def __init__(self, url: str = DEFAULT_URL, start_wait_s: float = 0.0) -> None:
        """`start_wait_s`: how long a refused connection is retried, for an emulator that was
        just started in the background and is still importing."""
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url + "/_emulator", timeout=10.0)
        self._start_wait_s = start_wait_s

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EmulatorAdmin:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        deadline = time.monotonic() + self._start_wait_s
        while True:
            try:
                response = self._http.request(method, path, json=body)
                break
            except httpx.ConnectError:
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                failure = "ConnectError"
            except httpx.TransportError as exc:
                failure = type(exc).__name__
            waited = f", waited {self._start_wait_s:g} s" if self._start_wait_s else ""
            raise EmulatorAdminError(
                f"cannot reach the emulator at {self.url} ({failure}{waited}); start one "
                "with `slurmgate emulator --pool cluster:NAME=COUNT`, or pass its --url",
                None,
            ) from None
        self._start_wait_s = 0.0  # it answered: later calls fail at once
        if response.status_code >= 400:
            try:
                said = str(response.json().get("message", response.text))
            except (ValueError, AttributeError):
                said = response.text
            raise EmulatorAdminError(
                f"emulator admin {method} {path} -> {response.status_code}: {said}",
                response.status_code,
            )
        return response.json()

    def runner_id(self, runner: str) -> int:
        """The id of the runner named `runner`, or `runner` itself when it is an id."""
        if runner.isdigit():
            return int(runner)
        runners = self.dump()["runners"]
        for item in runners:
            if item["name"] == runner:
                return int(item["id"])
        names = ", ".join(str(item["name"]) for item in runners[:5])
        raise EmulatorAdminError(
            f"no runner named {runner!r} on the emulator at {self.url}; give an id or a name "
            f"such as {names}{', ...' if len(runners) > 5 else ''}",
            404,
        )

    def add_job(
        self, labels: list[str], duration_s: float = 5.0, **job: Unpack[JobExtras]
    ) -> dict[str, int]:
        """Queue a job (`EmulatorState.add_job` over HTTP); returns {"id", "run_id"}."""
        body: dict[str, Any] = {"labels": labels, "duration_s": duration_s}
        body.update({key: value for key, value in job.items() if value is not None})
        result: dict[str, int] = self._call("POST", "/jobs", body)
        return result

    def add_runner(self, name: str, labels: list[str], status: str = "online") -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", "/runners", {"name": name, "labels": labels, "status": status}
        )
        return result

    def set_runner_status(self, runner_id: int, status: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", f"/runners/{runner_id}/status", {"status": status}
        )
        return result

    def complete_job(self, job_id: int, conclusion: str = "success") -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", f"/jobs/{job_id}/complete", {"conclusion": conclusion}
        )
        return result

    def cancel_job(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/jobs/{job_id}/cancel")
        return result

    def rerun(self, run_id: int) -> dict[str, Any]:
        """Re-run a completed run; returns {"run_id", "run_attempt", "job_ids"}."""
        result: dict[str, Any] = self._call("POST", f"/runs/{run_id}/rerun")
        return result

    def fault(self, kind: str, **spec: Any) -> dict[str, Any]:
        """Inject a fault: status, rate_limit, latency, fail_nth_write or hang_nth_write."""
        result: dict[str, Any] = self._call("POST", "/faults", {"kind": kind, **spec})
        return result

    def set_fault_plan(self, rate: float, seed: int = 0, **plan: Any) -> dict[str, Any]:
        """Random faults on `rate` of GitHub requests (kinds, retry_after_s, delay_s: FaultPlan)."""
        result: dict[str, Any] = self._call(
            "PUT", "/fault-plan", {"rate": rate, "seed": seed, **plan}
        )
        return result

    def fault_plan(self) -> dict[str, Any]:
        """The fault plan and how many faults of each kind it injected."""
        result: dict[str, Any] = self._call("GET", "/fault-plan")
        return result

    def clear_faults(self) -> None:
        self._call("DELETE", "/faults")

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/stats")
        return result

    def reset_stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/stats/reset")
        return result

    def dump(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/state")
        return result

    def set_quota(self, limit: int | None = None, window_s: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", "/quota", {"limit": limit, "window_s": window_s}
        )
        return result

    def set_webhooks(self, urls: list[str], secret: str | None = None) -> dict[str, Any]:
        """Send signed workflow_job webhooks to `urls` from now on ([] stops them)."""
        result: dict[str, Any] = self._call("POST", "/webhooks", {"urls": urls, "secret": secret})
        return result

    def tick(self) -> None:
        self._call("POST", "/tick")

    def label_pr(self, number: int, label: str, actor: str) -> dict[str, Any]:
        """`actor` adds `label` to pull request `number` (a `labeled` issue event)."""
        result: dict[str, Any] = self._call(
            "POST", f"/issues/{number}/labels", {"label": label, "actor": actor}
        )
        return result

    def unlabel_pr(self, number: int, label: str, actor: str) -> dict[str, Any]:
        """`actor` removes `label` from pull request `number` (an `unlabeled` issue event)."""
        body = {"label": label, "actor": actor, "action": "unlabeled"}
        result: dict[str, Any] = self._call("POST", f"/issues/{number}/labels", body)
        return result

    def set_team_member(self, team_slug: str, login: str, state: str | None = "active") -> None:
        """Make `login` an active or pending member of the owner's team, or no member (None)."""
        self._call("PUT", f"/teams/{team_slug}/members/{login}", {"state": state})

    def create_app(
        self,
        *,
        account: str | None = None,
        public_key: str | None = None,
        token_ttl_s: float | None = None,
        permissions: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Register a GitHub App installed on `account` (the emulator's owner by default),
        granting `permissions` (default: all the controller needs):
        {"app_id", "installation_id", "slug", "account", and "private_key" (PEM) unless
        `public_key` was given}."""
        body: dict[str, Any] = {"account": account, "public_key": public_key}
        if token_ttl_s is not None:
            body["token_ttl_s"] = token_ttl_s
        if permissions is not None:
            body["permissions"] = permissions
        result: dict[str, Any] = self._call("POST", "/apps", body)
        return result

    def expire_app_tokens(self, after_requests: int = 0) -> dict[str, Any]:
        """Expire every installation token now, or after `after_requests` more requests."""
        result: dict[str, Any] = self._call(
            "POST", "/apps/expire-tokens", {"after_requests": after_requests}
        )
        return result

    def suspend_installation(self, installation_id: int) -> dict[str, Any]:
        """Suspend an App's installation: no new tokens, and the issued ones refused."""
        result: dict[str, Any] = self._call(
            "POST", "/apps/suspend", {"installation_id": installation_id}
        )
        return result

    def app_stats(self) -> dict[str, Any]:
        """Apps, installations, tokens issued and refused, JWTs refused."""
        result: dict[str, Any] = self._call("GET", "/apps")
        return result
