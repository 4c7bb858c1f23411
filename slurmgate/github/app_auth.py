"""GitHub App authentication: sign the App's JWT, get and refresh installation tokens for httpx.

A GitHub App authenticates in two steps (https://docs.github.com/en/apps/creating-github-apps/
authenticating-with-a-github-app/authenticating-as-a-github-app-installation): it signs a
short-lived JWT with its private key (RS256; `iat` 60 s in the past against clock drift, `exp`
at most 10 minutes ahead, `iss` the App's id), and trades it for an installation access token
with `POST /app/installations/{installation_id}/access_tokens`. That token is what every REST
call carries; it expires after an hour (`expires_at`).

`InstallationTokenProvider` keeps one token per App installation, refreshes it 5 minutes before
it expires, and is shared by every client of the process (`shared_provider`), so a tick every
30 s does not mint a token each time; requests that find the token due at once wait for one
refresh (single flight) instead of each minting one. GitHub's answers to these requests are
read under a cap (``MAX_ANSWER_BYTES``, identity or one gzip). `GitHubAppAuth` is the httpx
auth plug-in the GitHub client uses: it sets the token on each request and, when GitHub
answers 401 to a cached token (revoked, or expired early by a skewed clock), refreshes once and
sends the request again.

The private key, the JWT and the tokens never appear in a repr, a log line or an exception.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey
from pydantic import SecretStr

from slurmgate.errors import ExternalError, InputError
from slurmgate.github.bodies import ACCEPT_ENCODING, BodyRefused, read_capped
from slurmgate.github.scope import GitHubScope
from slurmgate.settings.github import GitHubSettings

log = logging.getLogger(__name__)

APP_ID_ENV = "SLURMGATE_GITHUB_APP_ID"
APP_PRIVATE_KEY_ENV = "SLURMGATE_GITHUB_APP_PRIVATE_KEY"
APP_PRIVATE_KEY_FILE_ENV = "SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE"
APP_INSTALLATION_ID_ENV = "SLURMGATE_GITHUB_APP_INSTALLATION_ID"

JWT_BACKDATE_S = 60
"""`iat` this far in the past, as GitHub advises, so a clock that runs ahead is still accepted."""
JWT_LIFETIME_S = 540
"""`exp` this far ahead: under GitHub's 10-minute maximum, with room for a clock that lags."""
REFRESH_BEFORE_S = 300.0
"""Refresh an installation token this long before its `expires_at`."""
MAX_KEY_BYTES = 64 * 1024
MAX_TOKEN_CHARS = 1024
MAX_ANSWER_BYTES = 1024 * 1024
"""Largest answer read from the token and installation requests (a token answer is ~1 KiB)."""
FIX_KEY = (
    "generate a private key in the App's settings (Settings > Developer settings > GitHub Apps "
    f"> the App > Private keys) and give its .pem file as ${APP_PRIVATE_KEY_FILE_ENV} (or the "
    f"scope block's app_private_key), and check that ${APP_ID_ENV} is that App's id"
)


class AppCredentialsError(InputError):
    """GitHub App credentials that cannot work as given; the message names the field and fix."""


class AppAuthError(ExternalError):
    """GitHub refused the App's JWT or would not issue an installation token; one line that
    names the App id, the request and the fix. Carries no key, JWT or token."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status


class AppTokenUnavailable(AppAuthError):
    """GitHub could not be reached or failed (5xx) while issuing the installation token."""

    transient = True


_PEM = re.compile(r"(-----BEGIN [A-Z ]+-----)(.*?)(-----END [A-Z ]+-----)", re.S)


def _normalized_pem(pem: str) -> str:
    """PEM text as a one-line form field or secret store may have kept it (newlines turned into
    spaces or `\\n`), laid out again in 64-character lines."""
    text = pem.strip().replace("\\n", "\n")
    match = _PEM.fullmatch(text)
    if match is None:
        return text
    body = "".join(match.group(2).split())
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return "\n".join([match.group(1), *lines, match.group(3)]) + "\n"


def _load_key(pem: str, app_id: int) -> RSAPrivateKey:
    """The RSA private key of a PEM text; AppCredentialsError (without the key) otherwise."""
    data = _normalized_pem(pem).encode()
    if len(data) > MAX_KEY_BYTES:
        raise AppCredentialsError(
            f"app_private_key of GitHub App {app_id} is larger than {MAX_KEY_BYTES} bytes; "
            f"give the App's .pem private key file ({APP_PRIVATE_KEY_FILE_ENV})"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, RSAPrivateKey):
        raise AppCredentialsError(
            f"app_private_key of GitHub App {app_id} is not an unencrypted PEM RSA private key "
            "(-----BEGIN RSA PRIVATE KEY-----); give the .pem file GitHub generated for the App "
            f"({APP_PRIVATE_KEY_FILE_ENV}=path, or its text in {APP_PRIVATE_KEY_ENV})"
        )
    return key


@dataclass(frozen=True, eq=False, repr=False)
class GitHubAppCredentials:
    """A GitHub App's id, its private key (PEM) and, optionally, its installation's id.

    Without `installation_id` the installation is looked up from the scope's organization or
    repository (`GET /orgs/{org}/installation`, `GET /repos/{owner}/{repo}/installation`).
    """

    app_id: int
    private_key: SecretStr
    installation_id: int | None = None
    _key: RSAPrivateKey = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.app_id, bool) or not isinstance(self.app_id, int) or self.app_id < 1:
            raise AppCredentialsError(
                f"app_id {self.app_id!r} is not a GitHub App id; give the number shown as "
                "'App ID' on the App's settings page"
            )
        if self.installation_id is not None and (
            isinstance(self.installation_id, bool)
            or not isinstance(self.installation_id, int)
            or self.installation_id < 1
        ):
            raise AppCredentialsError(
                f"app_installation_id {self.installation_id!r} of GitHub App {self.app_id} is "
                "not an installation id; give the number at the end of the installation's "
                "settings URL, or leave it out to look it up from the org or repository"
            )
        key = self.private_key
        if not isinstance(key, SecretStr):
            key = SecretStr(str(key))
            object.__setattr__(self, "private_key", key)
        object.__setattr__(self, "_key", _load_key(key.get_secret_value(), self.app_id))

    def __repr__(self) -> str:
        return (
            f"GitHubAppCredentials(app_id={self.app_id}, private_key=SecretStr('**********'), "
            f"installation_id={self.installation_id})"
        )

    __str__ = __repr__

    @property
    def fingerprint(self) -> str:
        """A digest of the public key: tells two keys apart without showing either."""
        public = self._key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return hashlib.sha256(public).hexdigest()[:16]

    def jwt(self, now: float | None = None) -> str:
        """The App's JWT: RS256, `iat` 60 s back, `exp` 9 minutes ahead, `iss` the App id."""
        issued = int(time.time() if now is None else now)
        claims = {
            "iat": issued - JWT_BACKDATE_S,
            "exp": issued + JWT_LIFETIME_S,
            "iss": str(self.app_id),
        }
        return jwt.encode(claims, self._key, algorithm="RS256")


def read_private_key(
    path: str | Path, *, source: str = "$" + APP_PRIVATE_KEY_FILE_ENV
) -> SecretStr:
    """The PEM text of a key file; AppCredentialsError naming `source` when it cannot be read."""
    where = Path(path).expanduser()
    try:
        if where.stat().st_size > MAX_KEY_BYTES:
            raise AppCredentialsError(
                f"{source} names {str(where)!r}, larger than {MAX_KEY_BYTES} bytes: not a "
                "private key file; give the App's .pem file"
            )
        return SecretStr(where.read_text(encoding="ascii", errors="replace"))
    except OSError as exc:
        raise AppCredentialsError(
            f"{source} names {str(where)!r}, which cannot be read ({exc.strerror or exc}); "
            "give the path of the App's .pem private key file"
        ) from None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise AppCredentialsError(f"${name} is {raw[:40]!r}, not a positive number; {_ENV_FIX}")
    return int(raw)


_ENV_FIX = (
    f"set ${APP_ID_ENV} (the App id), ${APP_PRIVATE_KEY_FILE_ENV} (the .pem path) or "
    f"${APP_PRIVATE_KEY_ENV} (its text), and optionally ${APP_INSTALLATION_ID_ENV}"
)


def app_credentials_from_env(
    environ: Mapping[str, str] | None = None,
) -> GitHubAppCredentials | None:
    """The App credentials the environment names, or None when no App variable is set.

    The key comes from $SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE (a path) or
    $SLURMGATE_GITHUB_APP_PRIVATE_KEY (the PEM text; `\\n` escapes are accepted, as some
    secret stores keep one line).
    """
    env = GitHubSettings.environ() if environ is None else environ
    names = (APP_ID_ENV, APP_PRIVATE_KEY_ENV, APP_PRIVATE_KEY_FILE_ENV, APP_INSTALLATION_ID_ENV)
    if not any(env.get(name, "").strip() for name in names):
        return None
    app_id = _env_int(env, APP_ID_ENV)
    if app_id is None:
        raise AppCredentialsError(
            f"${APP_ID_ENV} is empty but other App variables are set; {_ENV_FIX}"
        )
    text = env.get(APP_PRIVATE_KEY_ENV, "").strip()
    path = env.get(APP_PRIVATE_KEY_FILE_ENV, "").strip()
    if text and path:
        raise AppCredentialsError(
            f"both ${APP_PRIVATE_KEY_ENV} and ${APP_PRIVATE_KEY_FILE_ENV} are set for GitHub "
            f"App {app_id}; set only one"
        )
    if path:
        key = read_private_key(path)
    elif text:
        key = SecretStr(text)
    else:
        raise AppCredentialsError(
            f"GitHub App {app_id} has no private key; set ${APP_PRIVATE_KEY_FILE_ENV} to the "
            f"path of its .pem file (or ${APP_PRIVATE_KEY_ENV} to its text)"
        )
    return GitHubAppCredentials(app_id, key, _env_int(env, APP_INSTALLATION_ID_ENV))


def credentials_from_env(
    environ: Mapping[str, str] | None = None,
) -> GitHubAppCredentials | SecretStr | None:
    """What the commands authenticate with: the App the $SLURMGATE_GITHUB_APP_* variables
    name, else $GITHUB_TOKEN, else None. The App wins when both are set."""
    env = GitHubSettings.environ() if environ is None else environ
    app = app_credentials_from_env(env)
    if app is not None:
        return app
    token = env.get("GITHUB_TOKEN", "").strip()
    return SecretStr(token) if token else None


# ---- installation tokens ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, repr=False)
class _Token:
    value: str
    expires_at: float  # as GitHub said, epoch seconds
    refresh_at: float  # by this machine's clock

    def __repr__(self) -> str:
        return f"_Token(value='**********', expires_at={self.expires_at})"


@dataclass(frozen=True, slots=True)
class _Answer:
    """GitHub's answer to one App request: its status, its JSON body (None when it is not
    JSON) and its reason phrase."""

    status: int
    body: Any
    reason: str


def _message(answer: _Answer) -> str:
    said = answer.body.get("message") if isinstance(answer.body, dict) else None
    text = str(said) if said else answer.reason or "error"
    return " ".join(text.split())[:200]


def _parse_time(value: Any) -> float | None:
    if not isinstance(value, str) or len(value) > 40:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None


class InstallationTokenProvider:
    """One App installation's access token: issued on first use, cached, refreshed 5 minutes
    before it expires, and dropped when GitHub refuses it. Safe to share between coroutines
    and threads (two that refresh at once both get a valid token)."""

    def __init__(
        self,
        credentials: GitHubAppCredentials,
        scope: GitHubScope,
        *,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.credentials = credentials
        self.scope = scope
        self.clock = clock
        self._transport = transport
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        # one refresh at a time per event loop: the coroutines that find the token due wait
        # for it instead of each minting one
        self._refreshing: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._token: _Token | None = None
        self._installation_id = credentials.installation_id
        self.issued = 0  # installation tokens obtained, for tests and logs

    def __repr__(self) -> str:
        return (
            f"InstallationTokenProvider(app_id={self.credentials.app_id}, "
            f"installation_id={self._installation_id}, api_url={self.scope.api_url!r})"
        )

    __str__ = __repr__

    @property
    def app_id(self) -> int:
        return self.credentials.app_id

    @property
    def installation_id(self) -> int | None:
        return self._installation_id

    async def token(self) -> tuple[str, bool]:
        """A valid installation token, and whether it was issued by this call."""
        cached = self._valid()
        if cached is not None:
            return cached.value, False
        loop = asyncio.get_running_loop()
        with self._lock:
            refreshing = self._refreshing.setdefault(loop, asyncio.Lock())
        async with refreshing:
            cached = self._valid()  # another coroutine may have refreshed it meanwhile
            if cached is not None:
                return cached.value, False
            fresh = await self._issue()
            with self._lock:
                self._token = fresh
        return fresh.value, True

    def _valid(self) -> _Token | None:
        with self._lock:
            cached = self._token
        return cached if cached is not None and self.clock() < cached.refresh_at else None

    def invalidate(self, token: str) -> None:
        """Forget `token` (GitHub refused it), unless a newer one already replaced it."""
        with self._lock:
            if self._token is not None and self._token.value == token:
                self._token = None

    async def _issue(self) -> _Token:
        async with httpx.AsyncClient(
            base_url=self.scope.api_url,
            follow_redirects=False,
            transport=self._transport,
            timeout=self._timeout_s,
            headers={
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": "slurmgate",
                "Accept-Encoding": ACCEPT_ENCODING,
            },
        ) as http:
            installation_id = self._installation_id or await self._look_up(http)
            path = f"/app/installations/{installation_id}/access_tokens"
            answer = await self._post_jwt(http, "POST", path)
            if answer.status != 201:
                raise self._refusal("POST", path, answer)
            body = answer.body
            value = body.get("token") if isinstance(body, dict) else None
            expires = _parse_time(body.get("expires_at")) if isinstance(body, dict) else None
            if (
                not isinstance(value, str)
                or not value
                or len(value) > MAX_TOKEN_CHARS
                or not value.isascii()
                or not value.isprintable()
                or " " in value
                or expires is None
            ):
                raise AppTokenUnavailable(
                    f"GitHub App {self.app_id}: POST {path} answered 201 without a usable "
                    "token and expires_at; retry later"
                )
        now = self.clock()
        lifetime = expires - now
        refresh_at = (
            expires - REFRESH_BEFORE_S
            if lifetime > 2 * REFRESH_BEFORE_S
            else now + max(0.0, lifetime / 2)
        )
        self.issued += 1
        log.info(
            "GitHub App %s: installation %s token issued, valid for %.0f s",
            self.app_id,
            installation_id,
            lifetime,
        )
        return _Token(value, expires, refresh_at)

    async def _look_up(self, http: httpx.AsyncClient) -> int:
        """The installation id on the scope's organization or repository."""
        if self.scope.org is not None:
            path, where = f"/orgs/{self.scope.org}/installation", f"organization {self.scope.org}"
        else:
            path, where = f"/repos/{self.scope.repo}/installation", f"repository {self.scope.repo}"
        answer = await self._post_jwt(http, "GET", path)
        if answer.status == 404:
            raise AppAuthError(
                f"GitHub App {self.app_id} is not installed on the {where} (GET {path} -> 404); "
                f"install the App there (the App's settings > Install App), or set "
                f"${APP_INSTALLATION_ID_ENV} / the block's app_installation_id",
                status=404,
            )
        if answer.status != 200:
            raise self._refusal("GET", path, answer)
        body = answer.body
        found = body.get("id") if isinstance(body, dict) else None
        if isinstance(found, bool) or not isinstance(found, int) or found < 1:
            raise AppTokenUnavailable(
                f"GitHub App {self.app_id}: GET {path} answered without an installation id; "
                f"set ${APP_INSTALLATION_ID_ENV} or retry later"
            )
        self._installation_id = found
        return found

    async def _post_jwt(self, http: httpx.AsyncClient, method: str, path: str) -> _Answer:
        """One request signed with a new JWT, its answer read capped; transport failures and
        refused bodies become AppTokenUnavailable, raised outside the `except` so no httpx
        object (holding the JWT) is chained."""
        headers = {"Authorization": f"Bearer {self.credentials.jwt(self.clock())}"}
        failure: str | None = None
        try:
            request = http.build_request(method, path, headers=headers)
            response = await http.send(request, stream=True)
            content = await read_capped(response, MAX_ANSWER_BYTES)
        except BodyRefused as refused:
            failure = f"its answer is {refused}"
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            failure = type(exc).__name__
        if failure is not None:
            raise AppTokenUnavailable(
                f"GitHub App {self.app_id}: {method} {path} failed ({failure}); check "
                f"{self.scope.api_url} is reachable, then retry"
            )
        try:
            body = json.loads(content) if content else None
        except (ValueError, RecursionError):
            body = None
        return _Answer(response.status_code, body, response.reason_phrase)

    def _refusal(self, method: str, path: str, answer: _Answer) -> AppAuthError:
        status = answer.status
        said = _message(answer)
        asked = f"{method} {path} -> {status}: {said}"
        if status == 401:
            return AppAuthError(
                f"GitHub App {self.app_id}: GitHub refused the App's signed JWT ({asked}); the "
                f"private key is not this App's, or the App id is wrong: {FIX_KEY}",
                status=status,
            )
        if status == 404:
            return AppAuthError(
                f"GitHub App {self.app_id}: no such installation ({asked}); set "
                f"${APP_INSTALLATION_ID_ENV} to the id of the App's installation on the "
                "organization or repository, or leave it empty to look it up",
                status=status,
            )
        if status == 403 or status == 422:
            return AppAuthError(
                f"GitHub App {self.app_id}: GitHub would not issue an installation token "
                f"({asked}); check the installation is not suspended and grants the "
                "permissions the scope needs",
                status=status,
            )
        error = AppTokenUnavailable(
            f"GitHub App {self.app_id}: installation token request failed ({asked}); retry later",
            status=status,
        )
        error.transient = status >= 500 or status == 429
        return error


_PROVIDERS: dict[tuple[Any, ...], InstallationTokenProvider] = {}
_PROVIDERS_LOCK = threading.Lock()


def shared_provider(
    credentials: GitHubAppCredentials,
    scope: GitHubScope,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> InstallationTokenProvider:
    """The process's one provider for this App, key and installation (on this API and scope):
    every client of a tick, and the ticks after it, share its token."""
    target = scope.org if scope.org is not None else scope.repo
    key = (
        scope.api_url,
        credentials.app_id,
        credentials.fingerprint,
        credentials.installation_id,
        target if credentials.installation_id is None else None,
        id(transport) if transport is not None else None,
    )
    with _PROVIDERS_LOCK:
        provider = _PROVIDERS.get(key)
        if provider is None:
            provider = InstallationTokenProvider(credentials, scope, transport=transport)
            _PROVIDERS[key] = provider
        return provider


class GitHubAppAuth(httpx.Auth):
    """httpx auth that sends the installation token, and on a 401 to a cached token refreshes
    it once and retries the request."""

    def __init__(self, provider: InstallationTokenProvider) -> None:
        self.provider = provider

    def __repr__(self) -> str:
        return f"GitHubAppAuth(app_id={self.provider.app_id})"

    __str__ = __repr__

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response]:
        raise RuntimeError("GitHubAppAuth works with httpx.AsyncClient only")
        yield request  # pragma: no cover - makes this a generator, as httpx expects

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token, fresh = await self.provider.token()
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401 and not fresh:
            log.info(
                "GitHub App %s: %s %s -> 401 with a cached installation token; refreshing it",
                self.provider.app_id,
                request.method,
                request.url.path,
            )
            self.provider.invalidate(token)
            token, _ = await self.provider.token()
            request.headers["Authorization"] = f"Bearer {token}"
            yield request
