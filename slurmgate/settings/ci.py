"""CI-side settings: what a GitHub workflow's step hands `slurmgate labels` in its environment."""

from __future__ import annotations

from pathlib import Path

from slurmgate.settings.part import Part, variable


class CISettings(Part):
    """The seed's two feature flags as the workflow passes them, where step outputs go, and the
    priority weights."""

    priority_scheduler_enabled: bool = variable(
        "PRIORITY_SCHEDULER_ENABLED",
        "Label jobs with their priority (on only when true, in any case, as the workflow "
        "templates test it).",
        False,
    )
    node_slot_scheduler_enabled: bool = variable(
        "NODE_SLOT_SCHEDULER_ENABLED",
        "Label jobs with their nodes:N (on only when true, in any case).",
        False,
    )
    github_output: Path | None = variable(
        "GITHUB_OUTPUT",
        "The step-output file GitHub Actions names; `slurmgate labels --github-output` "
        "appends to it.",
    )
    priority_policy: Path | None = variable(
        "SLURMGATE_PRIORITY_POLICY",
        "`slurmgate labels`' priority weights, from a policy file in InferenceX's "
        "ci-priority.yaml format (its --priority-policy option reads it; unset: the seed's).",
    )
    skip_queue_pr: str = variable(
        "SLURMGATE_SKIP_QUEUE_PR",
        "`slurmgate labels --skip-queue-pr`: the PR whose skip_queue label lets this job skip "
        "the queue (ci-skip-queue-pr-<PR>); empty: none.",
        "",
    )
    github_run_id: int | None = variable(
        "GITHUB_RUN_ID", "The workflow run's id, which GitHub Actions sets (`--run-id`)."
    )
    github_run_attempt: int | None = variable(
        "GITHUB_RUN_ATTEMPT",
        "The workflow run's attempt, which GitHub Actions sets (`--run-attempt`).",
    )
    github_event_name: str | None = variable(
        "GITHUB_EVENT_NAME",
        "The event that started the workflow, which GitHub Actions sets (`--event`; a "
        "push scores +2).",
    )
