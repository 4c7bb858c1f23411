"""The runner-label vocabulary: managed label families, their parsing and formatting."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from slurmgate.errors import InputError

CLUSTER_PREFIX = "cluster:"
LEASE_PREFIX = "ci-lease-"
JOB_PREFIX = "ci-job-"
ATTEMPT_PREFIX = "ci-attempt-"
NODES_PREFIX = "nodes:"
SKIP_QUEUE_PREFIX = "ci-skip-queue-pr-"
MAX_PR_NUMBER = 2**31 - 1
"""Largest pull request number a skip-queue label may carry (GitHub numbers issues and PRs as
int32)."""

# The job's own labels, which only the lease's anchor carries (what GitHub dispatches on).
# A skip-queue job asks for `ci-skip-queue-pr-<PR>` in its runs-on, so its anchor must carry it.
ANCHOR_PREFIXES = (JOB_PREFIX, ATTEMPT_PREFIX, NODES_PREFIX, SKIP_QUEUE_PREFIX)
# Only these families are ever removed from a runner; every other label is left alone.
MANAGED_PREFIXES = (LEASE_PREFIX, *ANCHOR_PREFIXES)

# The nonce is optional so that leases written before it existed still parse during an upgrade.
_LEASE_RE = re.compile(
    r"^ci-lease-j(?P<job>\d+)-a(?P<attempt>\d+)-t(?P<created>\d+)(?:-(?P<nonce>[0-9a-z]{1,16}))?$",
    re.ASCII,  # \d would take other scripts' digits, which int() reads as numbers
)
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
NONCE_LENGTH = 6
_JOB_RE = re.compile(r"^ci-job-(?P<score>-?\d+(?:\.\d+)?)-(?P<token>[0-9a-z][0-9a-z-]*)$", re.ASCII)


class LabelError(InputError):
    """A label that claims a managed family but does not follow its format."""


def fold(label: str) -> str:
    """GitHub compares labels case-insensitively; so do we."""
    return label.casefold()


def is_managed(label: str) -> bool:
    """True for the label families slurmgate owns and may remove."""
    return fold(label).startswith(MANAGED_PREFIXES)


def is_anchor_label(label: str) -> bool:
    """True for a job's own labels (ci-job-*, ci-attempt-*, nodes:*, ci-skip-queue-pr-*)."""
    return fold(label).startswith(ANCHOR_PREFIXES)


def is_cluster(label: str) -> bool:
    return fold(label).startswith(CLUSTER_PREFIX)


def check_managed_ascii(labels: list[str] | tuple[str, ...]) -> None:
    """Raise LabelError for a managed label with a non-ASCII character: case-folding rewrites
    it (straße becomes strasse), so the anchor would carry a label the job does not ask for."""
    for label in labels:
        if not label.isascii() and is_managed(label):
            shown = label.encode("ascii", "backslashreplace").decode()[:80]
            raise LabelError(
                f"runs-on label {shown!r} is a managed label (ci-job-*, ci-attempt-*, nodes:*, "
                "ci-skip-queue-pr-*) with a non-ASCII character; spell it in ASCII in the "
                "workflow's runs-on"
            )


def unmanaged(labels: list[str] | tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """The case-folded labels a runner must carry by itself (everything but managed families)."""
    return frozenset(fold(label) for label in labels if not is_managed(label))


def new_nonce() -> str:
    """A fresh random lease nonce: 6 base36 characters (about 2e9 values)."""
    return "".join(secrets.choice(_BASE36) for _ in range(NONCE_LENGTH))


@dataclass(frozen=True, slots=True)
class LeaseLabel:
    """`ci-lease-j<job id>-a<attempt>-t<created, unix seconds>-<nonce>`: the lease state.

    The nonce is drawn per admission. Two controllers admitting one job in the same second
    would otherwise write the same label, and their runners would read as one oversized lease
    that the conflict rule cannot split; with it they are two leases, and the rule keeps one.
    A label without a nonce (written by an older version) still parses, with `nonce` "".
    """

    job_id: int
    attempt: int
    created_at: int
    nonce: str = ""

    def __post_init__(self) -> None:
        if self.nonce and not re.fullmatch(r"[0-9a-z]{1,16}", self.nonce):
            raise LabelError(
                f"lease nonce {self.nonce!r} must be 1 to 16 lower-case base36 characters"
            )

    def render(self) -> str:
        stamp = f"{LEASE_PREFIX}j{self.job_id}-a{self.attempt}-t{self.created_at}"
        return f"{stamp}-{self.nonce}" if self.nonce else stamp

    @property
    def lease_id(self) -> str:
        return self.render()[len(LEASE_PREFIX) :]

    @classmethod
    def parse(cls, label: str) -> LeaseLabel:
        m = _LEASE_RE.match(fold(label))
        if not m:
            raise LabelError(
                f"lease label {label!r} is not ci-lease-j<job>-a<attempt>-t<unix time>-<nonce>"
            )
        return cls(int(m["job"]), int(m["attempt"]), int(m["created"]), m["nonce"] or "")


def is_lease(label: str) -> bool:
    return fold(label).startswith(LEASE_PREFIX)


@dataclass(frozen=True, slots=True)
class JobLabel:
    """`ci-job-<score>-<token>`: the job's unique dispatch gate, with its priority score."""

    score: Decimal
    token: str

    @classmethod
    def parse(cls, label: str) -> JobLabel:
        m = _JOB_RE.match(fold(label))
        if not m:
            raise LabelError(f"job label {label!r} is not ci-job-<decimal score>-<token>")
        try:
            score = Decimal(m["score"])
        except InvalidOperation as exc:  # the regex admits only decimals; keep the guard honest
            raise LabelError(f"job label {label!r} has a score that is not a decimal") from exc
        return cls(score, m["token"])

    def render(self) -> str:
        return f"{JOB_PREFIX}{self.score:.3f}-{self.token}"


def parse_nodes(labels: list[str] | tuple[str, ...]) -> int:
    """The node count a job requests: its single valid `nodes:N` label, or 1 when it has none.

    Raises LabelError naming the label when it is empty, not an integer, below 1, or repeated.
    """
    found = [label for label in labels if fold(label).startswith(NODES_PREFIX)]
    if not found:
        return 1
    if len(found) > 1:
        raise LabelError(
            f"job has {len(found)} nodes: labels ({', '.join(found)}); keep exactly one nodes:N"
        )
    raw = found[0][len(NODES_PREFIX) :].strip()
    if not raw:
        raise LabelError(f"label {found[0]!r} has no node count; write nodes:N with N >= 1")
    if not re.fullmatch(r"[0-9]+", raw):
        raise LabelError(f"label {found[0]!r} is not a whole number; write nodes:N with N >= 1")
    value = int(raw)
    if value < 1:
        raise LabelError(f"label {found[0]!r} asks for {value} nodes; N must be at least 1")
    return value


def nodes_label(count: int) -> str:
    return f"{NODES_PREFIX}{count}"


def attempt_label(attempt: int) -> str:
    return f"{ATTEMPT_PREFIX}{attempt}"


def pool_of(labels: list[str] | tuple[str, ...] | frozenset[str]) -> list[str]:
    """Every `cluster:<name>` label a runner carries, case-folded and sorted."""
    return sorted({fold(label) for label in labels if is_cluster(label)})
