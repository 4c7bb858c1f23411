"""Scrub credentials from text a run copies elsewhere: its own secret values and known patterns.

The shapes here are the one list of what a credential looks like: the redactor masks them in
what a run copies, and ``literal_credential`` finds them where a spec would store one in plain
text (argv, hook commands, env values), so the spec can refuse it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
# Shorter values would mask ordinary words and numbers all over a log.
MIN_SECRET_CHARS = 4

CREDENTIAL_WORDS = r"(?:api[_-]?key|access[_-]?key|secret|token|password|passwd|auth[_-]?string)"
CREDENTIAL_FLAG = re.compile(rf"^--[\w-]*{CREDENTIAL_WORDS}$", re.I)
"""A command-line flag whose value is a credential: --api-key, --hf-token, --password."""
CREDENTIAL_NAME = re.compile(
    r"(TOKEN|SECRET|PASSWORD|PASSWD|_KEY|APIKEY|AUTH_STRING|_PAT|CREDENTIALS?)$"
    r"|^(PREFECT_API_|GITHUB_TOKEN)",
    re.I,
)
"""A variable whose value is a credential: HF_TOKEN, GITHUB_PAT, *_CREDENTIALS, PREFECT_API_*."""

# Each shape: (what it is, the pattern, the group holding the secret; 0 when the match is it).
_SHAPES: tuple[tuple[str, re.Pattern[str], int], ...] = (
    # --api-key X, --hf-token=X, --password X: flags that carry a credential
    (
        "a credential flag's value",
        re.compile(rf"(--[\w-]*{CREDENTIAL_WORDS}(?:=|\s+))(\S+)", re.I),
        2,
    ),
    # Authorization: Bearer X (and Basic, token), as a header line or in a dict's repr
    (
        "an Authorization header's credentials",
        re.compile(
            r"(authorization['\"]?\s*[:=]\s*['\"]?(?:bearer|basic|token)\s+)([^\s'\"]+)", re.I
        ),
        2,
    ),
    # a URL's password: https://user:PASSWORD@host (git remotes, proxies, registries)
    ("a URL's password", re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)([^/\s@]+)(?=@)", re.I), 2),
    # NAME=VALUE, NAME: VALUE, 'api_key': ['X'] where NAME ends in a credential word
    (
        "a credential variable's value",
        re.compile(
            # a bare value that opens a mapping or a list, or is a number, is not a
            # credential: a benchmark's "time_to_first_token": {, "output_tokens": 25
            rf"(\b[\w.-]*{CREDENTIAL_WORDS}['\"]?\s*[:=]\s*)(\[?'[^']*'\]?|\[?\"[^\"]*\"\]?|"
            rf"(?![{{\[]|\d+(?:\.\d+)?(?:[\s,}}\]]|$))[^\s,}}\]]+)",
            re.I,
        ),
        2,
    ),
    # a PEM private key, whole: the run's etcd and NATS certificates' keys, a site's TLS key
    (
        "a private key (PEM)",
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"
            r".*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----",
            re.S,
        ),
        0,
    ),
    # well-known token shapes: GitHub, Hugging Face, OpenAI-style keys
    (
        "a GitHub token",
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
        0,
    ),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{20,}"), 0),
    ("an API key (sk-…)", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), 0),
)


def _is_reference(value: str) -> bool:
    """A shell expansion ($NAME, "${NAME}", $(cat FILE)) names a credential; it is not one."""
    return value.strip("'\"[]").startswith("$")


def literal_credential(text: str) -> str | None:
    """What kind of credential `text` holds literally (a token shape, a bearer header, a URL's
    password, a credential flag or variable with its value), or None. Never the value."""
    for kind, pattern, group in _SHAPES:
        for match in pattern.finditer(text):
            if not _is_reference(match.group(group)):
                return kind
    return None


class Redactor:
    """Masks the given secret values, then every known credential shape."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        # Longest first, so a value that contains another is masked whole.
        self.values = sorted(
            {v for v in values if len(v) >= MIN_SECRET_CHARS}, key=len, reverse=True
        )

    def __call__(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, MASK)
        for _, pattern, group in _SHAPES:
            text = pattern.sub(rf"\1{MASK}" if group else MASK, text)
        return text


redact_patterns = Redactor()
