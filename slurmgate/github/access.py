"""Check that a token can read a scope's runners, and say in one line why GitHub refused.

A wrong repository, a mistyped token and a token without the runner permission all look alike
from the tick (a 404 or a 401 deep in a flow run); commands call `check_access` first, so the
person sees the request, the cause and the permission to grant, before anything else starts.
"""

from __future__ import annotations

from pydantic import SecretStr

from slurmgate.errors import ExternalError
from slurmgate.github.app_auth import AppAuthError, GitHubAppCredentials
from slurmgate.github.errors import AuthError, GitHubError, RateLimited
from slurmgate.github.factory import client_for_scope
from slurmgate.github.scope import GitHubScope

REPO_RUNNER_PERMISSIONS = (
    'fine-grained "Administration: read and write" and "Actions: read" on the repository '
    "(a classic token: the repo scope)"
)
ORG_RUNNER_PERMISSIONS = (
    'the organisation permission "Self-hosted runners: read and write" '
    "(a classic token: the admin:org scope)"
)
APP_REPO_PERMISSIONS = (
    'the repository permissions "Administration: read and write" and "Actions: read"'
)
APP_ORG_PERMISSIONS = (
    'the organisation permission "Self-hosted runners: read and write" and the repository '
    'permission "Actions: read"'
)
APP_FIX = "in the App's settings (Permissions & events), then approve them on its installation"


class ScopeAccessError(ExternalError):
    """GitHub refused the scope's first read; the message names the request, cause and fix."""


def runner_permissions(scope: GitHubScope) -> str:
    """What a token needs to lease the scope's runners, as GitHub's settings page words it."""
    return REPO_RUNNER_PERMISSIONS if scope.repo is not None else ORG_RUNNER_PERMISSIONS


def app_permissions(scope: GitHubScope) -> str:
    """What a GitHub App must request to lease the scope's runners and read its jobs."""
    return APP_REPO_PERMISSIONS if scope.repo is not None else APP_ORG_PERMISSIONS


def app_id_of(credentials: str | SecretStr | GitHubAppCredentials) -> int | None:
    """The App id when the credentials are a GitHub App's; None for a token."""
    return credentials.app_id if isinstance(credentials, GitHubAppCredentials) else None


def explain(scope: GitHubScope, exc: GitHubError, app_id: int | None = None) -> str:
    """One line for a failed request: what was asked, what GitHub said, and what fixes it.

    With `app_id` the requests were made as that GitHub App, whose installation token the
    client had just been issued (an expired one is refreshed before anything fails), so a 401
    or 403 is about the installation, not a mistyped token.
    """
    asked = f"{exc.method} {exc.path}"
    needs = f"the token needs {runner_permissions(scope)}"
    if exc.status is None:
        return (
            f"cannot reach {scope.api_url} ({asked}: {exc.message}); check the API URL "
            "and that the server (GitHub, or the emulator) is up"
        )
    answered = f"GitHub answered {exc.status} for {asked}"
    if isinstance(exc, RateLimited):
        return f"{answered}: rate limited; retry in {exc.retry_after_s:.0f} s"
    target = scope.repo or scope.org
    what = "repository" if scope.repo is not None else "organisation"
    if app_id is not None:
        app = f"GitHub App {app_id}: {answered}"
        if exc.status == 404 and exc.path == scope.runners_path:
            return (
                f"{app}: the {what} {target} does not exist or the App's installation cannot "
                f"see it; install the App on {target} (or add the repository to the "
                "installation's selected ones)"
            )
        if exc.status == 401:
            return (
                f"{app} with an installation token GitHub had just issued: the installation "
                f"was suspended or removed, or the token revoked; check the App's installation "
                f"on {target} (Settings > GitHub Apps > Configure), then retry"
            )
        if exc.status == 403 and "suspended" in exc.message.casefold():
            return (
                f"{app} ({exc.message}): the App's installation on {target} is suspended; "
                "unsuspend it (Settings > GitHub Apps > Configure), then retry"
            )
        if isinstance(exc, AuthError) and exc.status == 403:
            return (
                f"{app} ({exc.message}{_accepting(exc)}): the App lacks a permission; grant it "
                f"{app_permissions(scope)} {APP_FIX}"
            )
        return f"{app}: {exc.message}"
    if exc.status == 404 and exc.path == scope.runners_path:
        return f"{answered}: the {what} does not exist or the token cannot see it; {needs}"
    if exc.status == 401:
        return (
            f"{answered}: the token is not valid (mistyped, expired or revoked); "
            f"give a valid token; {needs}"
        )
    if isinstance(exc, AuthError) and exc.status == 403:
        return f"{answered} ({exc.message}{_accepting(exc)}): the token lacks a permission; {needs}"
    return f"{answered}: {exc.message}"


def _accepting(exc: AuthError) -> str:
    """GitHub's own word on the permission the request needed, when it sent one."""
    return f"; GitHub accepts {exc.accepted_permissions}" if exc.accepted_permissions else ""


async def check_access(scope: GitHubScope, token: str | SecretStr | GitHubAppCredentials) -> int:
    """Read the scope's runners once; their count, or ScopeAccessError with `explain`'s line.

    One retry only: this is a person waiting at a prompt, and a server that is down stays down.
    Conditional, through the same ETag cache as the tick: on a steady fleet the check is a 304
    and costs no primary quota, so an idle `reconcile --once` stays free.
    """
    try:
        async with client_for_scope(scope, token, max_retries=1, backoff_base_s=0.2) as client:
            return len(await client.list_runners(conditional=True))
    except GitHubError as exc:
        raise ScopeAccessError(explain(scope, exc, app_id_of(token))) from None
    except AppAuthError as exc:  # the App's JWT or its installation token was refused
        raise ScopeAccessError(str(exc)) from None
