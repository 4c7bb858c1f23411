"""Where slurmgate reads and writes on GitHub: one repository or one organization, by name."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from slurmgate.errors import InputError

# GitHub's rules: a login (user or organization) is 1-39 letters, digits and single hyphens,
# neither first nor last; a repository name is 1-100 letters, digits, '-', '_' and '.'.
LOGIN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9]|-(?=[A-Za-z0-9])){0,38}$")
REPO_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def is_login(value: str) -> bool:
    return bool(LOGIN.fullmatch(value))


def is_loopback(host: str) -> bool:
    """localhost or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_repo(value: str) -> bool:
    """OWNER/NAME with a valid owner login and repository name."""
    owner, sep, name = value.partition("/")
    return (
        bool(sep)
        and is_login(owner)
        and bool(REPO_NAME.fullmatch(name))
        and name not in {".", ".."}
    )


class ScopeError(InputError):
    """No usable GitHub scope was given; the message names the parameter to fix."""


class GitHubScope(BaseModel):
    """Where the runners live: one repository (`repo`) or one organization (`org`).

    Runs and jobs are always repository-scoped; with `org`, `repos` names the repositories whose
    workflow runs are scanned for jobs, or `all_repos` reads them from GitHub
    (`GET /orgs/{org}/repos`: every repository the token or App installation can see). Either
    way the org's runners are one shared pool.
    """

    model_config = ConfigDict(frozen=True)

    api_url: str = "https://api.github.com"
    repo: str | None = None
    org: str | None = None
    repos: tuple[str, ...] = ()
    all_repos: bool = False

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"api_url {value!r} is not an http(s) URL; use e.g. https://api.github.com"
            )
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "api_url carries credentials; give the token separately and the URL without them"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"api_url {value!r} has a query or fragment; give the base URL only")
        if parts.scheme == "http" and not is_loopback(parts.hostname):
            # every request carries the token: in the clear only to this machine (the emulator)
            raise ValueError(
                f"api_url {value!r} is plain http to another host, which would send the token "
                "in the clear; use https (http is accepted only for loopback, e.g. 127.0.0.1)"
            )
        return value.rstrip("/")

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str | None) -> str | None:
        if value is not None and not is_repo(value):
            raise ValueError(f"repo {value!r} is not OWNER/NAME; write it like acme/gpu-ci")
        return value

    @field_validator("org")
    @classmethod
    def _org(cls, value: str | None) -> str | None:
        if value is not None and not is_login(value):
            raise ValueError(f"org {value!r} is not an organization login; write it like acme")
        return value

    @field_validator("repos")
    @classmethod
    def _repos(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            if not is_repo(item):
                raise ValueError(
                    f"repos entry {item!r} is not OWNER/NAME; write it like acme/gpu-ci"
                )
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> GitHubScope:
        if (self.repo is None) == (self.org is None):
            raise ValueError(
                "set exactly one of repo (OWNER/NAME, runners of one repository) "
                "or org (runners of an organization)"
            )
        if self.all_repos and self.org is None:
            raise ValueError("all_repos needs an org scope; with repo, list others in repos")
        if self.all_repos and self.repos:
            raise ValueError(
                "set either repos (a list) or all_repos (every repository the token can see), "
                "not both"
            )
        return self

    def covers(self, full_name: str) -> bool:
        """True when jobs of repository `full_name` (OWNER/NAME) belong to this scope."""
        wanted = full_name.casefold()
        if self.all_repos:
            return wanted.partition("/")[0] == (self.org or "").casefold()
        return wanted in {name.casefold() for name in (self.repo or "", *self.repos)}

    @property
    def runners_path(self) -> str:
        """The runner collection path, concrete (no placeholders)."""
        if self.repo is not None:
            return f"/repos/{self.repo}/actions/runners"
        return f"/orgs/{self.org}/actions/runners"

    @property
    def runners_template(self) -> str:
        if self.repo is not None:
            return "/repos/{owner}/{repo}/actions/runners"
        return "/orgs/{org}/actions/runners"

    @property
    def job_repos(self) -> tuple[str, ...]:
        """The repositories whose runs and jobs are read (never empty). With `all_repos` they
        are GitHub's to tell: ask the client (`GitHubClient.job_repos()`)."""
        if self.repo is not None:
            return (self.repo, *[r for r in self.repos if r != self.repo])
        if self.all_repos:
            raise ValueError(
                f"org scope {self.org!r} reads its repositories from GitHub (all_repos); "
                "use GitHubClient.job_repos()"
            )
        if not self.repos:
            # GitHub has no org-wide job listing; silently reading no jobs would admit nothing.
            raise ValueError(
                f"org scope {self.org!r} has no repos to read jobs from; "
                "set repos=(OWNER/NAME, ...) or all_repos=true on the GitHub scope"
            )
        return self.repos
