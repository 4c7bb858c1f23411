"""The emulator's GitHub Apps: JWT checks, installations and expiring installation tokens.

As GitHub does (https://docs.github.com/en/apps/creating-github-apps/authenticating-with-a-
github-app/authenticating-as-a-github-app-installation): an App is an id and a public key; a
request to an `/app/...` endpoint or an installation lookup carries a JWT the App signed with
its private key (RS256, `iss` the App id, `iat` not in the future, `exp` at most 10 minutes
ahead and not past, all by the emulator's clock); `POST /app/installations/{id}/access_tokens`
answers an installation token (`ghs_...`) with its `expires_at`; and the normal API answers 401
to an installation token that expired or was never issued. An installation grants permissions
(all the controller needs unless it was created with fewer); a request its token lacks one for
is answered 403 "Resource not accessible by integration" with the permissions GitHub would
accept in `X-Accepted-GitHub-Permissions` (https://github.blog/changelog/2023-08-10-x-accepted-
github-permissions-header-for-fine-grained-permission-actors).
"""

from __future__ import annotations

import hmac
import secrets
import string
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from slurmgate.errors import ExternalError, InputError

TOKEN_PREFIX = "ghs_"
"""GitHub's prefix of installation access tokens; the normal API checks such tokens here."""
DEFAULT_TOKEN_TTL_S = 3600.0
_TOKEN_CHARS = string.ascii_letters + string.digits
MAX_JWT_LIFETIME_S = 600
DOCS = "https://docs.github.com/rest/apps/apps"


class EmulatorWithApps(Protocol):
    """What the App routes use of the emulator's state (the state module imports this one)."""

    owner: str
    apps: AppRegistry

    def simple_user_json(
        self, login: str, *, user_id: int | None = None, kind: str = "User"
    ) -> dict[str, Any]: ...


class AppInputError(InputError):
    """Bad input to the emulator's App admin verbs; the message names the field."""


class AppRefusal(ExternalError):
    """An App endpoint's refusal (an emulated GitHub's), answered as GitHub's error JSON."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


PERMISSIONS = {
    "actions": "read",
    "administration": "write",
    "organization_self_hosted_runners": "write",
    "metadata": "read",
    "issues": "read",
    "members": "read",
}
"""What an installation grants by default: everything the README asks a real App to request
(repository or organisation runners read/write, Actions read, and skip-queue's Issues and
Members read)."""
LEVELS = {"read": 1, "write": 2, "admin": 3}
MAX_PERMISSIONS = 64


def _valid_permissions(permissions: Any) -> dict[str, str]:
    if not isinstance(permissions, dict) or len(permissions) > MAX_PERMISSIONS:
        raise AppInputError(
            f"permissions must be an object of at most {MAX_PERMISSIONS} names, "
            'e.g. {"actions": "read"}'
        )
    for name, level in permissions.items():
        if not (isinstance(name, str) and name.replace("_", "").isalpha() and name.islower()):
            raise AppInputError(f"permissions: {name!r} is not a permission name (a_z and _)")
        if level not in LEVELS:
            raise AppInputError(f"permissions.{name} must be one of read, write, admin")
    return dict(permissions)


def refusal_for(granted: dict[str, str], needs: tuple[str, ...], method: str) -> str | None:
    """None when `granted` holds one of `needs` at the method's level (read for GET, else
    write); otherwise the `X-Accepted-GitHub-Permissions` value GitHub answers with its 403."""
    level = "read" if method in ("GET", "HEAD") else "write"
    if not needs or any(LEVELS.get(granted.get(name, ""), 0) >= LEVELS[level] for name in needs):
        return None
    return "; ".join(f"{name}={level}" for name in needs)


@dataclass
class EmuApp:
    id: int
    slug: str
    public_key: rsa.RSAPublicKey
    token_ttl_s: float = DEFAULT_TOKEN_TTL_S


@dataclass
class EmuInstallation:
    id: int
    app_id: int
    account: str
    target_type: str = "Organization"
    created_at: float = field(default_factory=time.time)
    permissions: dict[str, str] = field(default_factory=lambda: dict(PERMISSIONS))
    suspended_at: float | None = None


@dataclass
class EmuToken:
    installation_id: int
    expires_at: float


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_private_key() -> str:
    """A fresh 2048-bit RSA private key as PEM, as GitHub's 'Generate a private key' gives."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()


class AppRegistry:
    """Apps, their installations and the installation tokens issued, behind one lock."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.apps: dict[int, EmuApp] = {}
        self.installations: dict[int, EmuInstallation] = {}
        self.tokens: dict[str, EmuToken] = {}
        self.issued = 0
        self.refused_tokens = 0
        self.refused_jwts = 0
        self._expire_after: int | None = None
        self._next_app = 310001
        self._next_installation = 4200001

    # ---- admin ----

    def create_app(
        self,
        account: str,
        *,
        public_key: str | None = None,
        target_type: str = "Organization",
        token_ttl_s: float = DEFAULT_TOKEN_TTL_S,
        slug: str | None = None,
        permissions: Any = None,
    ) -> tuple[EmuApp, EmuInstallation, str | None]:
        """Register an App installed on `account`; with no `public_key` a key pair is made and
        its private key returned (once, as GitHub's settings page hands it out). `permissions`
        (name -> read/write/admin) replaces what the installation grants."""
        granted = dict(PERMISSIONS) if permissions is None else _valid_permissions(permissions)
        private_pem: str | None = None
        if public_key is None:
            private_pem = new_private_key()
            loaded: Any = serialization.load_pem_private_key(private_pem.encode(), None)
            public = loaded.public_key()
        else:
            try:
                public = serialization.load_pem_public_key(public_key.encode())
            except (ValueError, TypeError):
                public = None
            if not isinstance(public, rsa.RSAPublicKey):
                raise AppInputError("public_key is not a PEM RSA public key")
        if target_type not in ("Organization", "User"):
            raise AppInputError("target_type must be Organization or User")
        if not (isinstance(token_ttl_s, int | float) and 1 <= token_ttl_s <= 86400):
            raise AppInputError("token_ttl_s must be a number of seconds in 1..86400")
        with self.lock:
            app = EmuApp(
                self._next_app, slug or f"slurmgate-{self._next_app}", public, float(token_ttl_s)
            )
            self._next_app += 1
            installation = EmuInstallation(
                self._next_installation, app.id, account, target_type, self.clock(), granted
            )
            self._next_installation += 1
            self.apps[app.id] = app
            self.installations[installation.id] = installation
        return app, installation, private_pem

    def suspend(self, installation_id: int) -> None:
        """Suspend an installation, as its owner can: no new tokens (403 "This installation has
        been suspended") and the ones issued are refused (401)."""
        with self.lock:
            installation = self.installations.get(installation_id)
            if installation is None:
                raise AppInputError(f"installation_id {installation_id} does not exist")
            installation.suspended_at = self.clock()

    def expire_tokens(self, after_requests: int = 0) -> None:
        """Expire every issued token now (0), or after `after_requests` more requests that
        carry a valid one: a token that dies mid-tick."""
        with self.lock:
            if after_requests <= 0:
                for token in self.tokens.values():
                    token.expires_at = min(token.expires_at, self.clock() - 1)
                self._expire_after = None
            else:
                self._expire_after = after_requests

    # ---- checks ----

    def verify_jwt(self, authorization: str) -> EmuApp:
        """The App whose valid JWT the Authorization header carries, or AppRefusal 401."""
        scheme, _, value = authorization.partition(" ")
        value = value.strip()
        if scheme.lower() != "bearer" or not value:
            raise AppRefusal(401, "A JSON web token could not be decoded")
        try:
            claims = jwt.decode(value, options={"verify_signature": False})
            app_id = int(str(claims.get("iss", "")))
        except (jwt.PyJWTError, ValueError):
            self.refused_jwts += 1
            raise AppRefusal(401, "A JSON web token could not be decoded") from None
        with self.lock:
            app = self.apps.get(app_id)
        if app is None:
            self.refused_jwts += 1
            raise AppRefusal(401, "Integration not found")
        try:
            claims = jwt.decode(
                value,
                app.public_key,
                algorithms=["RS256"],
                options={
                    "require": ["iat", "exp", "iss"],
                    "verify_exp": False,
                    "verify_iat": False,
                },
            )
        except jwt.PyJWTError:
            self.refused_jwts += 1
            raise AppRefusal(401, "A JSON web token could not be decoded") from None
        now = self.clock()
        iat, exp = claims["iat"], claims["exp"]
        if not isinstance(iat, int) or iat > now:
            self.refused_jwts += 1
            raise AppRefusal(
                401, "'Issued at' claim ('iat') must be an Integer representing a time in the past"
            )
        if not isinstance(exp, int) or exp <= now:
            self.refused_jwts += 1
            raise AppRefusal(401, "'Expiration time' claim ('exp') must be a time in the future")
        if exp - now > MAX_JWT_LIFETIME_S:
            self.refused_jwts += 1
            raise AppRefusal(401, "'Expiration time' claim ('exp') is too far in the future")
        return app

    def issue(self, app: EmuApp, installation_id: int) -> tuple[str, float]:
        with self.lock:
            installation = self.installations.get(installation_id)
            if installation is None or installation.app_id != app.id:
                raise AppRefusal(404, "Not Found")
            if installation.suspended_at is not None:
                raise AppRefusal(403, "This installation has been suspended")
            # GitHub's shape: ghs_ and 36 letters and digits
            token = TOKEN_PREFIX + "".join(secrets.choice(_TOKEN_CHARS) for _ in range(36))
            expires_at = self.clock() + app.token_ttl_s
            self.tokens[token] = EmuToken(installation_id, expires_at)
            self.issued += 1
            return token, expires_at

    def permissions_of(self, installation_id: int) -> dict[str, str]:
        with self.lock:
            installation = self.installations.get(installation_id)
            return dict(installation.permissions) if installation is not None else {}

    def installation_on(self, app: EmuApp, account: str) -> EmuInstallation | None:
        with self.lock:
            return next(
                (
                    i
                    for i in self.installations.values()
                    if i.app_id == app.id and i.account.casefold() == account.casefold()
                ),
                None,
            )

    def check_token(self, token: str) -> dict[str, str] | bool | None:
        """None: not an installation token (the normal token rules apply); issued and not
        expired: what its installation grants (counts toward `expire_tokens(after_requests=n)`);
        False: refuse it."""
        if not token.startswith(TOKEN_PREFIX):
            return None
        with self.lock:
            found = next(
                (t for key, t in self.tokens.items() if hmac.compare_digest(key, token)), None
            )
            if found is None or found.expires_at <= self.clock():
                self.refused_tokens += 1
                return False
            if self._expire_after is not None:
                self._expire_after -= 1
                if self._expire_after <= 0:
                    self._expire_after = None
                    for issued in self.tokens.values():
                        issued.expires_at = min(issued.expires_at, self.clock() - 1)
            installation = self.installations.get(found.installation_id)
            if installation is None or installation.suspended_at is not None:
                self.refused_tokens += 1
                return False
            return dict(installation.permissions)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "apps": len(self.apps),
                "installations": len(self.installations),
                "tokens_issued": self.issued,
                "tokens_refused": self.refused_tokens,
                "jwts_refused": self.refused_jwts,
            }

    # ---- answers ----

    def installation_json(
        self, installation: EmuInstallation, api_url: str, account: dict[str, Any]
    ) -> dict[str, Any]:
        """GitHub's `installation`; `account` is the account's `simple-user`."""
        app = self.apps[installation.app_id]
        stamp = _iso(installation.created_at)
        return {
            "id": installation.id,
            "account": account,
            "repository_selection": "all",
            "access_tokens_url": f"{api_url}/app/installations/{installation.id}/access_tokens",
            "repositories_url": f"{api_url}/installation/repositories",
            "html_url": (
                f"https://github.com/organizations/{installation.account}/settings/"
                f"installations/{installation.id}"
            ),
            "app_id": app.id,
            "client_id": f"Iv1.{app.id:016x}",
            "target_id": 1,
            "target_type": installation.target_type,
            "permissions": installation.permissions,
            "events": ["workflow_job"],
            "created_at": stamp,
            "updated_at": stamp,
            "single_file_name": None,
            "app_slug": app.slug,
            "suspended_at": (
                None if installation.suspended_at is None else _iso(installation.suspended_at)
            ),
            "suspended_by": None,
        }


# ---- routes -------------------------------------------------------------------------------------


def _refused(error: AppRefusal) -> Response:
    return JSONResponse(
        {"message": error.message, "documentation_url": DOCS, "status": str(error.status)},
        status_code=error.status,
    )


def app_routes(state: EmulatorWithApps) -> list[BaseRoute]:
    """GitHub's App endpoints the controller uses, authenticated with the App's JWT."""
    registry: AppRegistry = state.apps

    def base_url(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    async def access_tokens(request: Request) -> Response:
        try:
            app = registry.verify_jwt(request.headers.get("authorization", ""))
            try:
                installation_id = int(request.path_params["installation_id"])
            except ValueError:
                raise AppRefusal(404, "Not Found") from None
            token, expires_at = registry.issue(app, installation_id)
        except AppRefusal as error:
            return _refused(error)
        body = {
            "token": token,
            "expires_at": _iso(expires_at),
            "permissions": registry.permissions_of(installation_id),
            "repository_selection": "all",
        }
        return JSONResponse(body, status_code=201)

    def lookup(account: str, request: Request) -> Response:
        try:
            app = registry.verify_jwt(request.headers.get("authorization", ""))
            installation = registry.installation_on(app, account)
            if installation is None:
                raise AppRefusal(404, "Not Found")
        except AppRefusal as error:
            return _refused(error)
        account_json = state.simple_user_json(installation.account, kind=installation.target_type)
        return JSONResponse(
            registry.installation_json(installation, base_url(request), account_json)
        )

    async def org_installation(request: Request) -> Response:
        return lookup(request.path_params["org"], request)

    async def repo_installation(request: Request) -> Response:
        return lookup(request.path_params["owner"], request)

    return [
        Route(
            "/app/installations/{installation_id}/access_tokens", access_tokens, methods=["POST"]
        ),
        Route("/orgs/{org}/installation", org_installation, methods=["GET"]),
        Route("/repos/{owner}/{repo}/installation", repo_installation, methods=["GET"]),
    ]


def app_admin_routes(state: EmulatorWithApps, prefix: str) -> list[BaseRoute]:
    """`POST {prefix}/apps`: register an App installed on the emulator's owner (its private key
    in the answer when none was given); `POST {prefix}/apps/expire-tokens`; `POST
    {prefix}/apps/suspend` (an installation's owner suspends it)."""
    registry: AppRegistry = state.apps

    async def body_of(request: Request) -> dict[str, Any]:
        import json

        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            raise AppInputError("request body is not JSON") from None
        if not isinstance(body, dict):
            raise AppInputError("request body must be a JSON object")
        return body

    async def create(request: Request) -> Response:
        try:
            body = await body_of(request)
            app, installation, private_key = registry.create_app(
                str(body.get("account") or state.owner),
                public_key=body.get("public_key"),
                target_type=str(body.get("target_type", "Organization")),
                token_ttl_s=body.get("token_ttl_s", DEFAULT_TOKEN_TTL_S),
                permissions=body.get("permissions"),
            )
        except AppInputError as exc:
            return JSONResponse({"message": str(exc)}, status_code=400)
        answer: dict[str, Any] = {
            "app_id": app.id,
            "slug": app.slug,
            "installation_id": installation.id,
            "account": installation.account,
        }
        if private_key is not None:
            answer["private_key"] = private_key
        return JSONResponse(answer, status_code=201)

    async def expire(request: Request) -> Response:
        try:
            body = await body_of(request)
            after = body.get("after_requests", 0)
            if isinstance(after, bool) or not isinstance(after, int) or after < 0:
                raise AppInputError("after_requests must be a whole number >= 0")
        except AppInputError as exc:
            return JSONResponse({"message": str(exc)}, status_code=400)
        registry.expire_tokens(after)
        return JSONResponse(registry.stats())

    async def suspend(request: Request) -> Response:
        try:
            body = await body_of(request)
            installation_id = body.get("installation_id")
            if isinstance(installation_id, bool) or not isinstance(installation_id, int):
                raise AppInputError("installation_id must be an installation's id (a number)")
            registry.suspend(installation_id)
        except AppInputError as exc:
            return JSONResponse({"message": str(exc)}, status_code=400)
        return JSONResponse(registry.stats())

    async def stats(request: Request) -> Response:
        return JSONResponse(registry.stats())

    return [
        Route(f"{prefix}/apps", create, methods=["POST"]),
        Route(f"{prefix}/apps", stats, methods=["GET"]),
        Route(f"{prefix}/apps/expire-tokens", expire, methods=["POST"]),
        Route(f"{prefix}/apps/suspend", suspend, methods=["POST"]),
    ]
