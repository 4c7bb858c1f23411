"""Scrub credentials from text a run copies elsewhere: its own secret values and known patterns."""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
# Shorter values would mask ordinary words and numbers all over a log.
MIN_SECRET_CHARS = 4

CREDENTIAL_WORDS = r"(?:api[_-]?key|access[_-]?key|secret|token|password|passwd|auth[_-]?string)"
CREDENTIAL_FLAG = re.compile(rf"^--[\w-]*{CREDENTIAL_WORDS}$", re.I)
"""A command-line flag whose value is a credential: --api-key, --hf-token, --password."""
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # --api-key X, --hf-token=X, --password X: flags that carry a credential
    (re.compile(rf"(--[\w-]*{CREDENTIAL_WORDS}(?:=|\s+))(\S+)", re.I), rf"\1{MASK}"),
    # Authorization: Bearer X (and Basic, token), as a header line or in a dict's repr
    (
        re.compile(
            r"(authorization['\"]?\s*[:=]\s*['\"]?(?:bearer|basic|token)\s+)([^\s'\"]+)", re.I
        ),
        rf"\1{MASK}",
    ),
    # NAME=VALUE, NAME: VALUE, 'api_key': ['X'] where NAME ends in a credential word
    (
        re.compile(
            rf"(\b[\w.-]*{CREDENTIAL_WORDS}['\"]?\s*[:=]\s*)(\[?'[^']*'\]?|\[?\"[^\"]*\"\]?|[^\s,}}\]]+)",
            re.I,
        ),
        rf"\1{MASK}",
    ),
    # well-known token shapes: GitHub, Hugging Face, OpenAI-style keys
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"), MASK),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), MASK),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), MASK),
)


class Redactor:
    """Masks the given secret values, then every known credential pattern."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        # Longest first, so a value that contains another is masked whole.
        self.values = sorted(
            {v for v in values if len(v) >= MIN_SECRET_CHARS}, key=len, reverse=True
        )

    def __call__(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, MASK)
        for pattern, replacement in _PATTERNS:
            text = pattern.sub(replacement, text)
        return text


redact_patterns = Redactor()
