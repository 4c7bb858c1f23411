"""Admission settings: the two seed feature flags, the planner knobs, and the metrics file."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from slurmgate.settings.part import Part, variable

PolicyName = Literal["greedy", "easy", "conservative"]
"""The admission policies a deployment can choose (the simulator adds its `fcfs` baseline)."""
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
EstimatesName = Literal["timeout", "learned"]


class PoolPartition(BaseModel):
    """Where a `cluster:<pool>`'s jobs run in Slurm: a partition, optionally narrowed to nodes
    with a feature, or to one reservation's nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partition: str = Field(min_length=1, max_length=200, description="Slurm partition name.")
    feature: str | None = Field(
        default=None,
        max_length=200,
        description="Only nodes with this feature (AvailableFeatures) count, e.g. mi300x.",
    )
    reservation: str | None = Field(
        default=None,
        max_length=200,
        description="The managed jobs run in this reservation: only its nodes count.",
    )
    cluster: str | None = Field(
        default=None,
        max_length=100,
        description="The Slurm cluster of slurm_clusters the partition is in; unset: the "
        "controller's own (its SLURM_CONF, or SLURMGATE_SLURMRESTD_URL).",
    )


class SlurmCluster(BaseModel):
    """Where one Slurm cluster answers a capacity read: its slurm.conf (scontrol and squeue
    with that SLURM_CONF), or its slurmrestd with the token taken from an environment variable
    or a file (never written here, so the block holds no secret)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slurm_conf: str | None = Field(
        default=None, max_length=4096, description="Path of the cluster's slurm.conf."
    )
    slurmrestd_url: str | None = Field(
        default=None,
        max_length=4096,
        description="The cluster's slurmrestd: http(s)://host:port or unix:/path.",
    )
    slurmrestd_user: str | None = Field(default=None, max_length=200)
    slurmrestd_token_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,200}$",
        description="The environment variable (of the controller) holding its auth/jwt token.",
    )
    slurmrestd_token_file: str | None = Field(
        default=None, max_length=4096, description="A file holding its auth/jwt token."
    )
    slurmrestd_api_version: str = Field(default="v0.0.38", pattern=r"^v0\.0\.\d{2}$")
    timeout_s: float = Field(default=10.0, gt=0, le=120)

    @model_validator(mode="after")
    def _one_way(self) -> SlurmCluster:
        if (self.slurm_conf is None) == (self.slurmrestd_url is None):
            raise ValueError(
                "a slurm_clusters entry gives exactly one of slurm_conf (a path to its "
                "slurm.conf) and slurmrestd_url"
            )
        if self.slurmrestd_token_env and self.slurmrestd_token_file:
            raise ValueError("give slurmrestd_token_env or slurmrestd_token_file, not both")
        return self


REPO_PATTERN = r"^[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}$"
ANY_REPO = "*"
"""The `repo_limits` key whose limits apply to every repository the others do not name."""


class RepoLimits(BaseModel):
    """What the jobs of one repository may claim, whatever their labels say: a score ceiling,
    a quota of nodes held at once (over every pool), and a weight in the fair-share order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_score: Decimal | None = Field(
        default=None,
        ge=0,
        description="A job's ci-job-<score> above this counts as this (3 decimal places).",
    )
    max_nodes: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Nodes the repository's leases may hold at once, over every pool; a job "
        "that would take it past this waits (repo-quota). 0: none of its jobs is admitted.",
    )
    share: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="Fair-share weight: among jobs of equal score, the repository with the "
        "fewest nodes per unit of share goes first.",
    )

    @field_validator("max_score")
    @classmethod
    def _three_places(cls, value: Decimal | None) -> Decimal | None:
        return None if value is None else value.quantize(Decimal("0.001"))


class TeamLimits(BaseModel):
    """A team: repositories sharing one score ceiling and one node quota."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repos: list[str] = Field(
        min_length=1, max_length=10_000, description="The team's repositories, OWNER/NAME."
    )
    max_score: Decimal | None = Field(
        default=None, ge=0, description="A ceiling on the score of every job of the team."
    )
    max_nodes: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Nodes the team's repositories may hold at once together (team-quota).",
    )

    @field_validator("repos")
    @classmethod
    def _repo_names(cls, value: list[str]) -> list[str]:
        names = [_repo_name(name, "teams[...].repos") for name in value]
        return sorted(set(names))

    @field_validator("max_score")
    @classmethod
    def _three_places(cls, value: Decimal | None) -> Decimal | None:
        return None if value is None else value.quantize(Decimal("0.001"))


def _repo_name(name: object, field: str) -> str:
    text = str(name).strip()
    if not re.match(REPO_PATTERN, text):
        raise ValueError(
            f"{field}: {text[:100]!r} is not a repository; write it OWNER/NAME, e.g. acme/gpu-ci"
        )
    return text.casefold()  # GitHub's repository names ignore case


def pool_key(key: object, field: str) -> str:
    """A pool named with or without `cluster:`, as its label folds: `cluster:<name>`."""
    name = str(key).strip().casefold().removeprefix("cluster:")
    if not name or len(name) > 200 or any(c.isspace() for c in name):
        raise ValueError(
            f"{field} key {str(key)[:100]!r} must be a pool name such as mi300 or cluster:mi300 "
            f"(SLURMGATE_{field.upper()})"
        )
    return f"cluster:{name}"


FLAG_NAMES = ("PRIORITY_SCHEDULER_ENABLED", "NODE_SLOT_SCHEDULER_ENABLED")


def flag_value(name: str, raw: object) -> tuple[bool, str | None]:
    """A seed feature flag as its workflow templates test it: `vars.FLAG == 'true'`, which
    GitHub compares ignoring case. A text value is on only when it is `true` in any case;
    anything else is off, and a value that is neither `true` nor `false` (nor empty) comes
    with a note saying so (`1` and `yes` are on for pydantic, off for the workflows, and the
    controller must agree with the workflow that labelled the jobs). A bool is itself."""
    if isinstance(raw, bool):
        return raw, None
    text = str(raw)
    if text.casefold() == "true":
        return True, None
    if text in ("", "0") or text.casefold() == "false":
        return False, None
    return False, (
        f"{name}={text[:40]!r} reads as off: only true (in any case) turns it on, as the "
        f"workflow templates' `vars.{name} == 'true'` does; set it to true or false"
    )


def _knob(name: str, default: Any, description: str, **bounds: Any) -> Any:
    """A planner knob: keyword `name`, environment variable SLURMGATE_<NAME>, a default and the
    bounds pydantic checks (gt, ge, le). A mutable default is copied for every instance."""
    alias = AliasChoices(name, f"SLURMGATE_{name.upper()}")
    if isinstance(default, dict):
        return Field(
            default_factory=lambda: dict(default), validation_alias=alias, description=description
        )
    return Field(default=default, validation_alias=alias, description=description, **bounds)


class AdmissionSettings(BaseSettings):
    """What the planner reads besides the snapshot.

    Environment variables: the seed's two flags keep their bare names
    (`PRIORITY_SCHEDULER_ENABLED`, `NODE_SLOT_SCHEDULER_ENABLED`); the policy knobs are
    `SLURMGATE_POLICY`, `SLURMGATE_LEASE_MAX_QUEUED_AGE_S`, `SLURMGATE_ORPHAN_GRACE_S`,
    `SLURMGATE_DEFAULT_PRIORITY`, and for the reservation policies `SLURMGATE_ESTIMATES`,
    `SLURMGATE_TIMEOUT_MIN`, `SLURMGATE_TIMEOUT_OVERRIDES`, `SLURMGATE_ESTIMATE_QUANTILE`,
    `SLURMGATE_ESTIMATE_MIN_SAMPLES`, `SLURMGATE_OVERRUN_EXTENSION_S`,
    `SLURMGATE_RESERVE_AFTER_S`, `SLURMGATE_WIDE_FRACTION` and `SLURMGATE_RESERVATION_DEPTH`;
    Slurm as the capacity authority is `SLURMGATE_POOL_PARTITIONS`. Keyword arguments use the
    field names.

    With `PRIORITY_SCHEDULER_ENABLED` false the planner is inert for admission: it admits and
    cleans nothing, and only releases leases whose job finished or vanished, so switching the
    feature off drains cleanly. With `NODE_SLOT_SCHEDULER_ENABLED` false every job counts as one
    node: its `nodes:` label is ignored for sizing but is still a gate label on the anchor.
    `NODE_SLOT_SCHEDULER_ENABLED` without `PRIORITY_SCHEDULER_ENABLED` (a rollback done the wrong
    way round) counts as node slots off, and `flag_warnings` says so on every tick.
    """

    model_config = SettingsConfigDict(env_prefix="", populate_by_name=True, extra="ignore")

    # notes on flag values that read as off only because they are not `true` (`flag_value`)
    _flag_notes: tuple[str, ...] = PrivateAttr(default=())

    PRIORITY_SCHEDULER_ENABLED: bool = Field(
        default=False,
        description="Admit queued jobs by weighted runner leases in priority order (from the "
        "environment: on only when true, in any case, as the workflow templates test it).",
    )
    NODE_SLOT_SCHEDULER_ENABLED: bool = Field(
        default=False,
        description=(
            "Size each job by its nodes:N label (needs PRIORITY_SCHEDULER_ENABLED: without it "
            "this flag is ignored with a warning each tick); when false every job counts as 1 "
            "node. To roll back, turn this flag off before PRIORITY_SCHEDULER_ENABLED."
        ),
    )
    # EASY on learned estimates, wide jobs (> a quarter of their pool) reserved after 1 h and
    # backfilled beside at timeouts, chosen on KTH only in benchmarks/bench_policies.py against
    # its target (dominate classic EASY: wide-job max wait within 5% of EASY's, mean wait no
    # more than EASY's): the one method tried that meets it on all four KTH scenarios (the
    # results say where it stands held out).
    policy: PolicyName = _knob(
        "policy",
        "easy",
        "Ordering and fit policy of the planner (env SLURMGATE_POLICY): greedy (the seed: "
        "admit whatever fits, smaller jobs backfill at once; can starve wide jobs), easy "
        "(reserve the earliest start of the top blocked job of each pool, backfill only what "
        "does not delay it), conservative (a reservation for every blocked job up to "
        "reservation_depth).",
    )
    estimates: EstimatesName = _knob(
        "estimates",
        "learned",
        "Runtime estimates of the reservation policies (env SLURMGATE_ESTIMATES): the job "
        "timeout, or learned: a high quantile of the job key's past runtimes (timeout until "
        "estimate_min_samples runs are known). Reservations are planned on timeouts either "
        "way; a learned estimate only sizes a job starting beside a reservation.",
    )
    timeout_min: float = _knob(
        "timeout_min",
        480.0,
        "Timeout of a managed job, the bound of its runtime estimate (env "
        "SLURMGATE_TIMEOUT_MIN, minutes; the seed's multinode jobs use 480).",
        gt=0,
    )
    timeout_overrides: dict[str, float] = _knob(
        "timeout_overrides",
        {"agentic": 780.0},
        "Timeouts (minutes) for jobs whose name contains a word, case-insensitive, first "
        'match wins (env SLURMGATE_TIMEOUT_OVERRIDES as JSON, default {"agentic": 780}).',
    )
    estimate_quantile: float = _knob(
        "estimate_quantile",
        0.8,
        "Quantile of past runtimes used as a learned estimate (0 < q <= 1).",
        gt=0,
        le=1,
    )
    estimate_min_samples: int = _knob(
        "estimate_min_samples",
        3,
        "Past runs of a job key needed before its learned estimate is used.",
        ge=1,
    )
    overrun_extension_s: float = _knob(
        "overrun_extension_s",
        600.0,
        "A job running past its timeout is expected to end this many seconds from now, "
        "re-evaluated on every plan.",
        gt=0,
    )
    reserve_after_s: float = _knob(
        "reserve_after_s",
        3600.0,
        "easy/conservative: a blocked job gets a reservation only after waiting this long "
        "(env SLURMGATE_RESERVE_AFTER_S, seconds; default 1 h, chosen in "
        "benchmarks/bench_policies.py; 0 = at once, classic EASY). Like Slurm's "
        "bf_min_age_reserve.",
        ge=0,
    )
    wide_fraction: float | None = _knob(
        "wide_fraction",
        0.25,
        "easy/conservative: a job needing more than this part of its largest pool is wide "
        "(env SLURMGATE_WIDE_FRACTION, 0 < f <= 1; default 0.25, chosen in "
        "benchmarks/bench_policies.py). Only wide jobs wait reserve_after_s for a reservation "
        "(narrower ones are reserved at once), and a job starting beside a wide job's "
        "reservation is taken at its timeout, beside a narrow one at its learned estimate. "
        "null: every job waits for the trigger and is backfilled beside at its estimate.",
        gt=0,
        le=1,
    )
    reservation_depth: int = _knob(
        "reservation_depth",
        32,
        "Blocked jobs per pool that get a reservation under the conservative policy.",
        ge=1,
    )
    # The seed keeps a lease for as long as its anchor's job is queued. The expiry is a safety
    # net for a lease GitHub will never dispatch (a runs-on no runner can match, a runner whose
    # service is gone while it still shows online): it returns those N runners. Set short, it
    # can release a lease whose job GitHub was about to dispatch on a busy fleet, and the job
    # queues again behind the others; set long, a lease that can never dispatch holds its
    # runners that long. Sized from the job's timeout by default: a job is not expected to wait
    # for its anchor longer than it may run.
    lease_max_queued_age_s: float | None = _knob(
        "lease_max_queued_age_s",
        None,
        "A lease older than this while its job is still queued is released (env "
        "SLURMGATE_LEASE_MAX_QUEUED_AGE_S, seconds). Unset: the job's timeout (timeout_min, "
        "or its timeout_overrides entry). Shorter returns the runners of a lease GitHub never "
        "dispatches sooner, but may release a lease whose job was about to be dispatched on a "
        "busy fleet; the seed never expires a queued lease.",
        gt=0,
    )
    orphan_grace_s: float = _knob(
        "orphan_grace_s",
        30.0,
        "A lease without an anchor younger than this is left alone, because another "
        "controller may be between its label and anchor steps "
        "(env SLURMGATE_ORPHAN_GRACE_S, seconds). An anchor may be written up to two thirds "
        "of it after the lease (at least 20 s): a longer grace lets more admissions share one "
        "verification read at GitHub's write pace, and keeps a crashed controller's lease "
        "longer. Every controller of a fleet must use the same grace.",
        ge=0,
    )
    skip_queue_team: str | None = _knob(
        "skip_queue_team",
        None,
        "Who may make a PR skip the queue: members of this team, written org/team-slug "
        "(env SLURMGATE_SKIP_QUEUE_TEAM). The actor who last added the skip-queue label to the "
        "PR must be an active member.",
    )
    skip_queue_allow: frozenset[str] = _knob(
        "skip_queue_allow",
        frozenset(),
        "Logins who may make a PR skip the queue, besides the team "
        '(env SLURMGATE_SKIP_QUEUE_ALLOW as JSON, e.g. ["alice", "bob"]).',
    )
    skip_queue_label: str = _knob(
        "skip_queue_label",
        "skip_queue",
        "The PR label that asks for skip-queue (env SLURMGATE_SKIP_QUEUE_LABEL).",
        min_length=1,
        max_length=100,
    )
    pool_partitions: dict[str, PoolPartition] = _knob(
        "pool_partitions",
        {},
        "Slurm as the capacity authority: each cluster:<pool> (key, with or without the "
        "cluster: prefix) mapped to its partition, optionally a feature and a reservation "
        '(env SLURMGATE_POOL_PARTITIONS as JSON, e.g. {"mi300": {"partition": "gpu", '
        '"feature": "mi300x"}} or {"mi300": "gpu"}). A mapped pool admits no more nodes than '
        "Slurm can give a managed job now; unmapped pools count runners only. When Slurm does "
        "not answer, every pool counts runners only for that tick (one warning).",
    )
    slurm_clusters: dict[str, SlurmCluster] = _knob(
        "slurm_clusters",
        {},
        "Slurm clusters besides the controller's own, by name, for pool_partitions' cluster "
        '(env SLURMGATE_SLURM_CLUSTERS as JSON, e.g. {"east": {"slurm_conf": '
        '"/etc/slurm-east/slurm.conf"}, "west": {"slurmrestd_url": "https://west:6820", '
        '"slurmrestd_user": "ci", "slurmrestd_token_env": "WEST_SLURM_TOKEN"}}). Each is read '
        "on its own and fails open alone: its pools count runners only for that tick.",
    )
    cordoned_pools: dict[str, str] = _knob(
        "cordoned_pools",
        {},
        "Cordoned pools, each with why (env SLURMGATE_CORDONED_POOLS as JSON, e.g. "
        '{"h100": "node swap until Friday"}): nothing new is admitted there, running and '
        "already-admitted leases finish, and the board says cordoned, then drained once no "
        "lease is left. `slurmgate cordon POOL` and `slurmgate uncordon POOL` edit a saved "
        "policy block's.",
    )
    repo_limits: dict[str, RepoLimits] = _knob(
        "repo_limits",
        {},
        "Fairness between repositories: per OWNER/NAME (or * for every repository not named) "
        "a score ceiling (max_score), a node quota over every pool (max_nodes) and a "
        "fair-share weight (share) (env SLURMGATE_REPO_LIMITS as JSON, e.g. "
        '{"acme/bench": {"max_score": 3, "max_nodes": 16}, "*": {"max_score": 2}}). A job\'s '
        "ci-job-<score> above its ceiling counts as the ceiling; a job that would take its "
        "repository past the quota waits (repo-quota).",
    )
    teams: dict[str, TeamLimits] = _knob(
        "teams",
        {},
        "Teams of repositories sharing a score ceiling and a node quota (env SLURMGATE_TEAMS "
        'as JSON, e.g. {"inference": {"repos": ["acme/a", "acme/b"], "max_nodes": 24}}); a '
        "repository belongs to at most one team; a job that would take its team past the "
        "quota waits (team-quota).",
    )
    fair_share: bool = _knob(
        "fair_share",
        True,
        "Among queued jobs of equal score, repositories take turns (env SLURMGATE_FAIR_SHARE): "
        "the one whose leases hold the fewest nodes per unit of share (repo_limits) goes "
        "next. Off: fewer nodes, then older, first, whatever the repository.",
    )
    default_priority: Decimal = _knob(
        "default_priority",
        Decimal("1.000"),
        "Score of a job without a ci-job-<score>-<token> label "
        "(env SLURMGATE_DEFAULT_PRIORITY, decimal, 3 places).",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _read_flags(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """The two flags read as the workflow templates read them (`flag_value`), with a note
        for each value that reads as off only because it is not `true`."""
        notes: list[str] = []
        if isinstance(data, dict):
            data = dict(data)
            for name in FLAG_NAMES:
                if name in data and not isinstance(data[name], bool):
                    data[name], note = flag_value(name, data[name])
                    if note:
                        notes.append(note)
        settings = handler(data)
        settings._flag_notes = tuple(notes)
        return settings

    @field_validator("wide_fraction", mode="before")
    @classmethod
    def _no_wide_fraction(cls, value: object) -> object:
        """`null` or `none` (any case) in the environment turns the wide-job rules off."""
        if isinstance(value, str) and value.strip().casefold() in ("null", "none"):
            return None
        return value

    @field_validator("timeout_overrides")
    @classmethod
    def _positive_timeouts(cls, value: dict[str, float]) -> dict[str, float]:
        for word, minutes in value.items():
            if not word.strip() or minutes <= 0:
                raise ValueError(
                    f"timeout_overrides entry {word!r}: {minutes} must map a non-empty word to "
                    "a positive number of minutes"
                )
        return {word.casefold(): minutes for word, minutes in value.items()}

    @field_validator("pool_partitions", mode="before")
    @classmethod
    def _partitions(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        pools: dict[str, Any] = {}
        for key, target in value.items():
            if isinstance(target, str):
                target = {"partition": target}
            pools[pool_key(key, "pool_partitions")] = target
        return pools

    @model_validator(mode="after")
    def _known_clusters(self) -> AdmissionSettings:
        for pool, target in self.pool_partitions.items():
            if target.cluster is not None and target.cluster not in self.slurm_clusters:
                known = ", ".join(sorted(self.slurm_clusters)) or "none"
                raise ValueError(
                    f"pool_partitions[{pool}].cluster {target.cluster!r} is not in slurm_clusters "
                    f"(known: {known}); add it there, or leave cluster unset for the "
                    "controller's own Slurm"
                )
        return self

    @field_validator("cordoned_pools", mode="before")
    @classmethod
    def _cordons(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        cordons: dict[str, str] = {}
        for key, why in value.items():
            text = " ".join(str(why if why is not None else "").split())[:200]
            cordons[pool_key(key, "cordoned_pools")] = text or "cordoned"
        return cordons

    @field_validator("repo_limits", mode="before")
    @classmethod
    def _repo_keys(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        keys: dict[str, Any] = {}
        for key, limits in value.items():
            name = ANY_REPO if str(key).strip() == ANY_REPO else _repo_name(key, "repo_limits")
            if name in keys:
                raise ValueError(f"repo_limits names {name} twice (case does not count)")
            keys[name] = limits
        return keys

    @field_validator("teams")
    @classmethod
    def _one_team_each(cls, value: dict[str, TeamLimits]) -> dict[str, TeamLimits]:
        seen: dict[str, str] = {}
        for team, limits in sorted(value.items()):
            if not team.strip() or len(team) > 100:
                raise ValueError(
                    f"teams key {team[:100]!r} must be a team name of 1-100 characters"
                )
            for repo in limits.repos:
                if repo in seen:
                    raise ValueError(
                        f"teams: {repo} is in both {seen[repo]} and {team}; a repository "
                        "belongs to at most one team"
                    )
                seen[repo] = team
        return value

    @field_validator("skip_queue_team")
    @classmethod
    def _team_slug(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        org, _, team = value.strip().partition("/")
        if not org or not team or "/" in team:
            raise ValueError(
                f"skip_queue_team {value!r} must be written org/team-slug, e.g. my-org/ci-admins"
            )
        return f"{org}/{team}"

    @field_validator("skip_queue_allow")
    @classmethod
    def _logins(cls, value: frozenset[str]) -> frozenset[str]:
        return frozenset(login.strip().casefold() for login in value if login.strip())

    def queued_lease_limit_s(self, job_name: str) -> float:
        """How long a lease may wait for its job to start: the knob, or the job's timeout."""
        if self.lease_max_queued_age_s is not None:
            return self.lease_max_queued_age_s
        return self.timeout_s(job_name)

    def timeout_s(self, job_name: str) -> float:
        """The timeout of a job, in seconds: the first override whose word is in its name."""
        name = job_name.casefold()
        for word, minutes in self.timeout_overrides.items():
            if word in name:
                return minutes * 60.0
        return self.timeout_min * 60.0

    @field_validator("default_priority")
    @classmethod
    def _three_places(cls, value: Decimal) -> Decimal:
        return value.quantize(Decimal("0.001"))

    @property
    def flag_warnings(self) -> tuple[str, ...]:
        """Why the flags do not mean what they say: one line per problem, for each tick's log.

        NODE_SLOT_SCHEDULER_ENABLED without PRIORITY_SCHEDULER_ENABLED is the rollback done the
        wrong way round. It is not an error here: refusing the settings would stop every tick,
        and with it the release of finished leases. The node-slot flag is ignored instead (the
        planner then only drains), and the block form, where a person types, refuses it.
        """
        if self.NODE_SLOT_SCHEDULER_ENABLED and not self.PRIORITY_SCHEDULER_ENABLED:
            return (
                *self._flag_notes,
                "NODE_SLOT_SCHEDULER_ENABLED=true is ignored because PRIORITY_SCHEDULER_ENABLED "
                "is false: node slots are off, nothing is admitted, and only leases whose job "
                "finished or vanished are released. Unset NODE_SLOT_SCHEDULER_ENABLED (to roll "
                "back, turn NODE_SLOT_SCHEDULER_ENABLED off first, then "
                "PRIORITY_SCHEDULER_ENABLED)",
            )
        return self._flag_notes

    @property
    def node_slots(self) -> bool:
        """True when jobs are sized by their nodes:N label (both flags on)."""
        return self.PRIORITY_SCHEDULER_ENABLED and self.NODE_SLOT_SCHEDULER_ENABLED


class AdmissionMetricsSettings(Part):
    """Where each tick's Prometheus metrics go besides the served /metrics."""

    metrics_textfile: Path | None = variable(
        "SLURMGATE_METRICS_TEXTFILE",
        "Write each tick's metrics to this file for node_exporter's textfile collector "
        "(unset: not written).",
    )
