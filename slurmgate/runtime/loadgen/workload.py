"""What a chat load sends and when: prompt and output lengths, arrivals, Retry-After's wait.

Prompts are random common words, about one token each, so no two share a cached prefix; their
lengths and the answers' are drawn from a seeded distribution (`Lengths`), as a real workload's
vary. Requests arrive closed-loop at a concurrency or open-loop at a rate (Poisson or constant
gaps), and a 429's Retry-After says how long a well-behaved client holds off.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from slurmgate.errors import InputError

MAX_LENGTH = 1_000_000


PROMPT_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "other",
    "what",
    "time",
    "up",
    "out",
    "some",
    "into",
    "could",
    "then",
    "them",
    "these",
    "two",
    "may",
)


class LoadInputError(InputError):
    """A load setting that cannot be used; the message names the option and the fix."""


def retry_after_seconds(value: str, now: float | None = None) -> float:
    """Seconds to wait for a Retry-After value: delay-seconds or an HTTP-date; 0 if unreadable."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if when.tzinfo is None:
        return 0.0
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: fixed, uniform, normal or lognormal (seedable).

    Written as ``N`` (fixed), ``uniform:LO,HI``, ``normal:MEAN,STD`` or ``lognormal:MEAN,STD``
    (the mean and standard deviation of the lengths themselves). Samples are whole numbers,
    at least 1 and at most ``MAX_LENGTH``; a normal draw below 1 is drawn again.
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, option: str) -> Lengths:
        raw = text.strip().lower()
        hint = f"{option} {text!r}: use N, uniform:LO,HI, normal:MEAN,STD or lognormal:MEAN,STD"
        kind, _, args = raw.partition(":")
        try:
            if not args:
                value = int(kind)
                if not 1 <= value <= MAX_LENGTH:
                    raise LoadInputError(f"{option} {text!r} must be in 1..{MAX_LENGTH}")
                return cls("fixed", float(value))
            first, sep, second = args.partition(",")
            if not sep:
                raise LoadInputError(hint)
            a, b = float(first), float(second)
        except ValueError:
            raise LoadInputError(hint) from None
        if not (math.isfinite(a) and math.isfinite(b)):
            raise LoadInputError(hint)
        if kind == "uniform":
            if not 1 <= a <= b <= MAX_LENGTH:
                raise LoadInputError(f"{option} {text!r}: need 1 <= LO <= HI <= {MAX_LENGTH}")
        elif kind in ("normal", "lognormal"):
            if not (1 <= a <= MAX_LENGTH and 0 <= b <= MAX_LENGTH):
                raise LoadInputError(
                    f"{option} {text!r}: need 1 <= MEAN <= {MAX_LENGTH} and 0 <= STD"
                )
        else:
            raise LoadInputError(hint)
        return cls(kind, a, b)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            return rng.randint(math.ceil(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
            for _ in range(64):  # truncated at 1: draw again rather than pile up at the edge
                if value >= 0.5:
                    break
                value = rng.gauss(self.a, self.b)
        else:
            sigma2 = math.log1p((self.b / self.a) ** 2)
            value = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        return min(MAX_LENGTH, max(1, round(value)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


def arrival_gaps(rate: float, arrivals: str, rng: random.Random) -> Iterator[float]:
    """Seconds between request arrivals at ``rate`` per second: exponential gaps (a Poisson
    process, as independent users arrive) or constant ones."""
    while True:
        yield rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate


def prompt_text(words: int, rng: random.Random) -> str:
    """About ``words`` tokens of text (common short words are one token each in the usual
    tokenizers); random, so no two prompts share a cached prefix."""
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(words))


@dataclass(frozen=True)
class ChatLoadSpec:
    """A streaming chat load: closed loop at ``concurrency``, or open loop at ``rate``."""

    url: str
    model: str = "stub-model"
    path: str = "/v1/chat/completions"
    concurrency: int = 8
    rate: float | None = None
    arrivals: str = "poisson"
    max_in_flight: int = 1024
    duration: float | None = 10.0
    requests: int | None = None
    prompt_tokens: Lengths = Lengths("fixed", 32.0)
    output_tokens: Lengths = Lengths("fixed", 64.0)
    seed: int = 0
    ignore_eos: bool = True
    timeout: float = 300.0
    idle_timeout: float = 60.0
    honour_retry_after: bool = True
    max_retry_after: float = 30.0
    label: str = "endpoint"
    headers: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        if self.concurrency < 1:
            raise LoadInputError("--concurrency must be >= 1")
        if self.rate is not None and not (0 < self.rate <= 100_000 and math.isfinite(self.rate)):
            raise LoadInputError("--rate must be > 0 requests per second (and at most 100000)")
        if self.arrivals not in ("poisson", "constant"):
            raise LoadInputError(f"--arrivals {self.arrivals!r}: use poisson or constant")
        if self.max_in_flight < 1:
            raise LoadInputError("--max-in-flight must be >= 1")
        if self.duration is None and self.requests is None:
            raise LoadInputError("set --duration or --requests (or both), or the run never ends")
        if self.duration is not None and self.duration <= 0:
            raise LoadInputError("--duration must be > 0 seconds")
        if self.requests is not None and self.requests < 1:
            raise LoadInputError("--requests must be >= 1")
        if self.timeout <= 0 or self.idle_timeout <= 0:
            raise LoadInputError("--timeout must be > 0 seconds")

    def body(self, rng: random.Random) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "user", "content": prompt_text(self.prompt_tokens.sample(rng), rng)}
            ],
            "max_tokens": self.output_tokens.sample(rng),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang and llama.cpp: generate max_tokens tokens
        return body
