"""GitHub's typed errors, and which one a failed answer becomes (its status, its message).

An error carries the request's method, path template and path as sent, never the token or an
httpx request object; what GitHub said is cut to a printable line first, since a hostile
answer must not break the line or drive the terminal.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from slurmgate.errors import ExternalError, NotFoundError


class GitHubError(ExternalError):
    """A GitHub request that did not succeed. Carries no token and no httpx request object."""

    def __init__(
        self,
        method: str,
        template: str,
        status: int | None,
        message: str,
        *,
        path: str | None = None,
    ) -> None:
        self.method = method
        self.template = template  # what call counters and retry rules key on
        self.path = path or template  # the request as sent, which is what a person can check
        self.status = status
        self.message = message
        super().__init__(
            f"{method} {self.path} -> {status if status is not None else 'no response'}: {message}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Prefect may pickle a failed task's exception; the default would call __init__ with
        # the one formatted message and fail to load it.
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


def refused_repository(exc: GitHubError) -> bool:
    """A 404, or a 403 that is not a rate limit: GitHub will not show this repository."""
    return isinstance(exc, NotFound) or (isinstance(exc, AuthError) and exc.status == 403)


def _rebuild_error(cls: type[GitHubError], text: str, fields: dict[str, Any]) -> GitHubError:
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    error.__dict__.update(fields)
    return error


class NotFound(GitHubError, NotFoundError):
    """404: the runner, label, run or job does not exist."""


class ValidationFailed(GitHubError):
    """422: GitHub rejected the request body or the operation; retrying cannot help."""


class AuthError(GitHubError):
    """401, or a 403 that is not a rate limit: the token is wrong or lacks a permission.

    `accepted_permissions` is GitHub's `X-Accepted-GitHub-Permissions` on a 403 (the permission
    sets any one of which would do, e.g. `administration=write`), when it is well formed.
    """

    def __init__(
        self,
        method: str,
        template: str,
        status: int | None,
        message: str,
        *,
        path: str | None = None,
        accepted_permissions: str | None = None,
    ) -> None:
        super().__init__(method, template, status, message, path=path)
        self.accepted_permissions = accepted_permissions


_PERMISSION_SETS = re.compile(
    r"[a-z_]{1,64}=(read|write|admin)(\s*[,;]\s*[a-z_]{1,64}=(read|write|admin)){0,15}"
)


def accepted_permissions(headers: httpx.Headers) -> str | None:
    """GitHub's `X-Accepted-GitHub-Permissions`, or None when absent or not of its shape (a
    hostile or broken answer must not put arbitrary text into an error line)."""
    value = headers.get("x-accepted-github-permissions", "").strip()
    return value if len(value) <= 512 and _PERMISSION_SETS.fullmatch(value) else None


class MalformedResponse(GitHubError):
    """A 2xx answer slurmgate refuses: not JSON, too large, the wrong shape, too many pages, or
    a pagination link to another host. Retrying the same request would get the same answer."""


class TransientError(GitHubError):
    """5xx, timeouts and connection errors that outlasted every retry."""

    transient = True


class RateLimited(GitHubError):
    """Primary or secondary rate limit that outlasted every retry; wait `retry_after_s` seconds."""

    transient = True

    def __init__(
        self,
        method: str,
        template: str,
        status: int | None,
        message: str,
        retry_after_s: float,
        *,
        path: str | None = None,
    ) -> None:
        super().__init__(
            method, template, status, f"{message} (retry after {retry_after_s:.1f} s)", path=path
        )
        self.retry_after_s = retry_after_s


# What a status no retry helps means, as an error; a 403 here is not a rate limit. Any other
# status is a plain GitHubError.
STATUS_ERRORS: dict[int, type[GitHubError]] = {
    401: AuthError,
    403: AuthError,
    404: NotFound,
    422: ValidationFailed,
}


def status_error(
    method: str, template: str, status: int, message: str, sent: str, headers: httpx.Headers
) -> GitHubError:
    kind = STATUS_ERRORS.get(status, GitHubError)
    if status == 403:
        permissions = accepted_permissions(headers)
        return AuthError(
            method, template, status, message, path=sent, accepted_permissions=permissions
        )
    return kind(method, template, status, message, path=sent)


def error_message(response: httpx.Response, content: bytes) -> str:
    """GitHub's `message` (and `errors`), at most 500 printable characters: it ends up in a
    one-line error, and a hostile answer must not break the line or drive the terminal."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return _printable(response.reason_phrase or "error")
    if isinstance(body, dict):
        message = str(body.get("message") or response.reason_phrase or "error")
        errors = body.get("errors")
        if errors:
            message += f" ({'; '.join(str(e) for e in errors)[:300]})"
        return _printable(message[:500])
    return _printable(response.reason_phrase or "error")


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else " " for c in text)
