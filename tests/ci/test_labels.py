"""`slurmgate labels` and `node-count`: the seed's runs-on table (docs/seed.md), JSON, errors."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from slurmgate.admission.labels import SKIP_QUEUE_PREFIX, JobLabel, is_anchor_label, parse_nodes
from slurmgate.ci.priority import (
    PriorityContext,
    job_label,
    queue_namespace,
    queue_token,
    score,
)
from slurmgate.ci.runs_on import (
    OUTPUT_KEYS,
    CIError,
    LabelFlags,
    RunContext,
    compute_labels,
    flags_from_env,
    load_spec,
    resolve_node_count,
    spec_from_data,
)
from slurmgate.cli.app import app

RUN = RunContext(run_id=4242, run_attempt=2)
ROW: dict[str, Any] = {"runner": "cluster:h100-dgxc", "node-count": 3, "model-prefix": "dsr1"}


def labels_for(row: dict[str, Any], priority: bool, node_slots: bool, **kw: Any) -> list[str]:
    spec = spec_from_data(row, "row")
    return list(compute_labels(spec, LabelFlags(priority, node_slots), RUN, **kw).runs_on)


def expected_gate(row: dict[str, Any]) -> str:
    value = score(row, PriorityContext())
    return job_label(value, queue_token(row, queue_namespace(4242, 2)))


# ---- the seed's table, row by row -----------------------------------------------------------


@pytest.mark.parametrize("node_slots", [False, True])
def test_priority_off_is_the_legacy_runner_label_only(node_slots: bool) -> None:
    assert labels_for(ROW, False, node_slots) == ["cluster:h100-dgxc"]
    assert labels_for({**ROW, "node-count": ""}, False, node_slots) == ["cluster:h100-dgxc"]


def test_both_flags_and_a_node_count_give_the_full_weighted_set() -> None:
    got = labels_for(ROW, True, True)
    assert got == [
        "self-hosted",
        "cluster:h100-dgxc",
        "nodes:3",
        expected_gate(ROW),
        "ci-attempt-2",
    ]
    # the planner reads these labels back: the same node count and score
    assert parse_nodes(got) == 3
    assert JobLabel.parse(got[3]).score == Decimal("1.748")


@pytest.mark.parametrize("empty", ["", "   ", None])
def test_empty_node_count_falls_back_to_the_unweighted_set(empty: object) -> None:
    row = {**ROW, "node-count": empty}
    got = labels_for(row, True, True)
    assert not any(label.startswith("nodes:") for label in got)
    assert got[:2] == ["self-hosted", "cluster:h100-dgxc"] and got[-1] == "ci-attempt-2"
    # scored as a single-node row (no node term), token over the row as written
    gate = JobLabel.parse(got[2])
    assert gate.score == Decimal("1.750")
    assert gate.token == queue_token(row, queue_namespace(4242, 2))


def test_node_slot_flag_off_never_emits_nodes() -> None:
    got = labels_for(ROW, True, False)
    assert got == ["self-hosted", "cluster:h100-dgxc", expected_gate(ROW), "ci-attempt-2"]


def test_single_node_row_gets_the_literal_nodes_1() -> None:
    row = {"runner": "cluster:h100-dgxc", "framework": "vllm"}
    got = labels_for(row, True, True)
    assert "nodes:1" in got
    assert JobLabel.parse(got[3]).score == Decimal("1.500")


def test_run_attempt_and_namespace_change_the_token() -> None:
    spec = spec_from_data(ROW, "row")
    flags = LabelFlags(True, True)
    first = compute_labels(spec, flags, RUN)
    rerun = compute_labels(spec, flags, RunContext(run_id=4242, run_attempt=3))
    family = compute_labels(spec, flags, RunContext(run_id=4242, run_attempt=2, family="mn"))
    assert first.token != rerun.token != family.token
    assert rerun.attempt_label == "ci-attempt-3"
    assert family.token == queue_token(ROW, queue_namespace(4242, 2, "mn"))


def test_push_event_and_pr_labels_flow_into_the_score() -> None:
    spec = spec_from_data(ROW, "row")
    flags = LabelFlags(True, True)
    push = compute_labels(spec, flags, RunContext(4242, 2, event="push"))
    patch = compute_labels(spec, flags, RunContext(4242, 2, pr_labels=frozenset({"ci-patchwork"})))
    assert push.score == "3.748"
    assert patch.score == "0.000"


def test_runner_option_overrides_and_labels_are_deduplicated_case_insensitively() -> None:
    got = labels_for(ROW, True, True, runner="Self-Hosted")
    assert [label.casefold() for label in got].count("self-hosted") == 1


def test_allocation_spec_takes_its_node_count_from_the_layout(data: Path) -> None:
    spec = load_spec(data / "allocation.yaml")
    assert (spec.kind, spec.nodes) == ("allocation", 3)
    result = compute_labels(spec, LabelFlags(True, True), RUN, runner="cluster:a")
    assert "nodes:3" in result.runs_on
    assert result.score == "0.998"  # base 1.0 and -0.001 per node beyond the first
    with pytest.raises(CIError, match="--runner"):
        compute_labels(spec, LabelFlags(True, True), RUN)


def test_missing_run_id_names_the_option() -> None:
    spec = spec_from_data(ROW, "row")
    with pytest.raises(CIError, match="--run-id is missing"):
        compute_labels(spec, LabelFlags(True, True), RunContext(run_attempt=1))
    # legacy mode needs no run context at all
    assert compute_labels(spec, LabelFlags(False, False), RunContext()).runs_on == (
        "cluster:h100-dgxc",
    )


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({**ROW, "node-count": 0}, "node-count"),
        ({**ROW, "node-count": "three"}, "node-count"),
        ({**ROW, "node-count": True}, "node-count"),
        ({"node-count": 2}, "runner"),
        ({**ROW, "runner": 7}, "runner"),
        ({"runner": "b300", "multinode": True, "disagg": True, "num-nodes": 2}, "num-nodes"),
    ],
)
def test_bad_rows_name_the_field(row: dict[str, Any], field: str) -> None:
    with pytest.raises(CIError, match=field):
        compute_labels(spec_from_data(row, "row"), LabelFlags(True, True), RUN)


def test_flags_from_env_are_on_only_when_true_in_any_case() -> None:
    # the workflow templates test `vars.FLAG == 'true'`, which GitHub compares ignoring case
    assert flags_from_env({}) == LabelFlags(False, False)
    on = {"PRIORITY_SCHEDULER_ENABLED": "true", "NODE_SLOT_SCHEDULER_ENABLED": "TRUE"}
    assert flags_from_env(on) == LabelFlags(True, True)
    off = flags_from_env({"PRIORITY_SCHEDULER_ENABLED": "1", "NODE_SLOT_SCHEDULER_ENABLED": "No"})
    assert (off.priority, off.node_slots) == (False, False)
    # both off as the workflow reads them, and each says so
    first, second = off.notes
    assert "PRIORITY_SCHEDULER_ENABLED='1' reads as off" in first
    assert "NODE_SLOT_SCHEDULER_ENABLED='No' reads as off" in second
    assert flags_from_env({"NODE_SLOT_SCHEDULER_ENABLED": "FALSE"}).notes == ()


def test_cli_takes_yes_as_off_with_a_note(cli: CliRunner, tmp_path: Path) -> None:
    row = tmp_path / "row.json"
    row.write_text(json.dumps({"runner": "cluster:h100", "node-count": 2}))
    env = {"PRIORITY_SCHEDULER_ENABLED": "yes", "NODE_SLOT_SCHEDULER_ENABLED": "True"}
    result = cli.invoke(app, ["labels", str(row)], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs-on"] == ["cluster:h100"]  # the legacy set
    assert "PRIORITY_SCHEDULER_ENABLED='yes' reads as off" in result.stderr


# ---- historical rows: no node-count, and a count that cannot be derived ----------------------

# A multinode row written before node counts existed, re-run today: no node-count field, and
# its runner label is in no hardware table (none is given here, as in most workflows).
HISTORICAL: dict[str, Any] = {
    "runner": "gb200",
    "multinode": True,
    "disagg": True,
    "model-prefix": "dsr1",
    "framework": "dynamo-sglang",
    "prefill": {"num-worker": 1, "tp": 4, "additional-settings": []},
    "decode": {"num-worker": 1, "tp": 8, "additional-settings": []},
}
BOTH_FLAGS_ARGS = ["--priority", "--node-slots", "--run-id", "4242", "--run-attempt", "2"]


@pytest.mark.parametrize(
    ("priority", "node_slots"), [(False, False), (False, True), (True, False), (True, True)]
)
def test_historical_row_gets_the_unweighted_set_under_every_flag(
    cli: CliRunner, tmp_path: Path, priority: bool, node_slots: bool
) -> None:
    flags = ["--priority" if priority else "--no-priority"]
    flags.append("--node-slots" if node_slots else "--no-node-slots")
    args = ["labels", str(write_row(tmp_path, HISTORICAL)), *flags]
    result = cli.invoke(app, [*args, "--run-id", "4242", "--run-attempt", "2"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    if not priority:
        assert doc["runs-on"] == ["gb200"] and doc["mode"] == "legacy"
        return
    # scored as one node: 1.0 base + 1.25 multi-node + 0.75 dsr1 + 0.5 dynamo-sglang
    gate = expected_gate(HISTORICAL)
    assert gate.startswith("ci-job-3.500-")
    assert doc["runs-on"] == ["self-hosted", "gb200", gate, "ci-attempt-2"]
    assert doc["nodes"] is None
    if node_slots:
        assert "historical row" in result.stderr and "'gb200'" in result.stderr
        assert "seed's guard" in result.stderr


def test_historical_row_is_sized_when_the_hardware_is_known(cli: CliRunner, tmp_path: Path):
    hardware = tmp_path / "hardware.yaml"
    hardware.write_text("gb200: 4\n")
    args = ["labels", str(write_row(tmp_path, HISTORICAL)), "--hardware", str(hardware)]
    result = cli.invoke(app, [*args, *BOTH_FLAGS_ARGS])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["nodes"] == 1 + 2 and "nodes:3" in doc["runs-on"]
    assert doc["score"] == "3.498" and result.stderr == ""  # 3.500 less 0.001 a node past one


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"node-count": "three"}, "node-count"),
        ({"node-count": 0}, "node-count"),
        ({"node-count": "²"}, "node-count"),  # a digit to str.isdigit, not to int
        ({"disagg": False, "num-nodes": 0}, "num-nodes"),
        (
            {"decode": {"num-worker": 1, "tp": 8, "additional-settings": ["DECODE_NODES=x"]}},
            "DECODE_NODES",
        ),
        ({"decode": {"num-worker": 1, "tp": "eight"}}, "decode.tp"),
        ({"decode": {"num-worker": 1, "tp": 8, "additional-settings": ["DECODE_NODES=³"]}}, "³"),
        ({"prefill": "1x4"}, "prefill"),
    ],
)
def test_a_row_that_claims_an_invalid_count_is_still_an_error(
    cli: CliRunner, tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    path = write_row(tmp_path, {**HISTORICAL, **change})
    result = cli.invoke(app, ["labels", str(path), *BOTH_FLAGS_ARGS])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and field in line, line


def test_node_count_command_still_explains_a_historical_row(cli: CliRunner, tmp_path: Path):
    # asked for the count itself, the command says why it cannot give one
    result = cli.invoke(app, ["node-count", str(write_row(tmp_path, HISTORICAL))])
    assert (
        result.exit_code == 2 and "'gb200'" in result.stderr and "hardware table" in result.stderr
    )


# ---- skip-queue ------------------------------------------------------------------------------


@pytest.mark.parametrize("node_slots", [False, True])
def test_skip_queue_pr_of_the_row_is_the_last_label_when_priority_is_on(node_slots: bool) -> None:
    row = {**ROW, "framework": "sglang-x", "precision": "fp4", "skip-queue-pr": 2440}
    got = labels_for(row, True, node_slots)
    assert got[-2:] == ["ci-attempt-2", f"{SKIP_QUEUE_PREFIX}2440"]
    assert got[-1] == "ci-skip-queue-pr-2440" and is_anchor_label(got[-1])
    assert labels_for(row, False, node_slots) == ["cluster:h100-dgxc"]
    # the seed scores a skip-queue row like any other: sglang + fp4 on one node is 2.250
    single = {"runner": "h100", "framework": "sglang-x", "precision": "fp4", "skip-queue-pr": "7"}
    result = compute_labels(spec_from_data(single, "row"), LabelFlags(True, node_slots), RUN)
    assert result.score == "2.250" and result.runs_on[-1] == "ci-skip-queue-pr-7"


def test_skip_queue_pr_option_and_environment(cli: CliRunner, tmp_path: Path, monkeypatch) -> None:
    path = str(write_row(tmp_path, ROW))
    args = ["labels", path, "--priority", "--node-slots", "--run-id", "9", "--run-attempt", "1"]
    result = cli.invoke(app, [*args, "--skip-queue-pr", "2740"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs-on"][-1] == "ci-skip-queue-pr-2740"
    monkeypatch.setenv("SLURMGATE_SKIP_QUEUE_PR", "31")
    assert json.loads(cli.invoke(app, args).stdout)["runs-on"][-1] == "ci-skip-queue-pr-31"
    # an empty workflow input is "no skip-queue", not an error
    monkeypatch.setenv("SLURMGATE_SKIP_QUEUE_PR", "")
    result = cli.invoke(app, args)
    assert result.exit_code == 0 and json.loads(result.stdout)["runs-on"][-1] == "ci-attempt-1"
    # the row and the input may both name the PR, but the same one
    both = ["labels", str(write_row(tmp_path, {**ROW, "skip-queue-pr": 31})), *args[2:]]
    result = cli.invoke(app, [*both, "--skip-queue-pr", "31"])
    assert json.loads(result.stdout)["runs-on"].count("ci-skip-queue-pr-31") == 1
    result = cli.invoke(app, [*both, "--skip-queue-pr", "32"])
    assert (
        result.exit_code == 2 and "skip-queue-pr is 31 but --skip-queue-pr is 32" in result.stderr
    )


@pytest.mark.parametrize("bad", ["0", "-3", "1.5", "abc", "2147483648", "12 34", "²", "١٢"])
def test_skip_queue_pr_option_is_validated(cli: CliRunner, tmp_path: Path, bad: str) -> None:
    path = str(write_row(tmp_path, ROW))
    result = cli.invoke(app, ["labels", path, *BOTH_FLAGS_ARGS, "--skip-queue-pr", bad])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "--skip-queue-pr must be a pull-request number from 1 to 2147483647" in line


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "x", 2**31, [1]])
def test_skip_queue_pr_of_the_row_is_validated(bad: object) -> None:
    with pytest.raises(CIError, match="row: skip-queue-pr must be a pull-request number"):
        spec_from_data({**ROW, "skip-queue-pr": bad}, "row")


@pytest.mark.parametrize(("given", "number"), [(1, 1), (" 42 ", 42), (2**31 - 1, 2**31 - 1)])
def test_skip_queue_pr_bounds_are_github_issue_numbers(given: object, number: int) -> None:
    # every number accepted here is one the controller reads back from the label (int32)
    assert spec_from_data({**ROW, "skip-queue-pr": given}, "row").skip_queue_pr == number


# ---- the CLI ----------------------------------------------------------------------------------


def write_row(tmp_path: Path, row: dict[str, Any]) -> Path:
    path = tmp_path / "row.json"
    path.write_text(json.dumps(row))
    return path


def test_cli_prints_json_for_fromjson_and_github_outputs(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_file = tmp_path / "github_output"
    monkeypatch.setenv("PRIORITY_SCHEDULER_ENABLED", "true")
    monkeypatch.setenv("NODE_SLOT_SCHEDULER_ENABLED", "true")
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    monkeypatch.setenv("GITHUB_RUN_ATTEMPT", "2")
    monkeypatch.setenv("GITHUB_OUTPUT", str(out_file))
    result = cli.invoke(app, ["labels", str(write_row(tmp_path, ROW)), "--github-output"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert tuple(doc) == OUTPUT_KEYS
    assert doc["runs-on"] == labels_for(ROW, True, True)
    assert (doc["nodes"], doc["mode"], doc["attempt-label"]) == (3, "node-slots", "ci-attempt-2")
    lines = dict(line.split("=", 1) for line in out_file.read_text().splitlines())
    assert tuple(lines) == OUTPUT_KEYS
    assert json.loads(lines["runs-on"]) == doc["runs-on"]


def test_cli_reads_stdin_and_honours_flag_overrides(cli: CliRunner) -> None:
    result = cli.invoke(
        app,
        ["labels", "-", "--priority", "--no-node-slots", "--run-id", "9", "--run-attempt", "1"],
        input=json.dumps({**ROW, "node-count": ""}),
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["mode"] == "priority" and doc["nodes"] is None
    assert not any(label.startswith("nodes:") for label in doc["runs-on"])


def test_cli_guard_note_goes_to_stderr(cli: CliRunner, tmp_path: Path) -> None:
    row = write_row(tmp_path, {**ROW, "node-count": ""})
    args = ["labels", str(row), "--priority", "--node-slots", "--run-id", "9", "--run-attempt", "1"]
    result = cli.invoke(app, args)
    assert result.exit_code == 0
    assert "seed's guard" in result.stderr
    assert json.loads(result.stdout)["nodes"] is None


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("runner: [unclosed", "not valid YAML or JSON"),
        ("- a\n- b\n", "expected a mapping"),
        (json.dumps({**ROW, "node-count": -1}), "node-count must be a positive integer"),
        ("name: x\ndeployments: []\nclient: {command: [echo]}\n", "deployments"),
    ],
)
def test_cli_bad_spec_is_one_line_and_exit_2(
    cli: CliRunner, tmp_path: Path, content: str, needle: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = cli.invoke(
        app, ["labels", str(path), "--priority", "--run-id", "1", "--run-attempt", "1"]
    )
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in result.output


def test_cli_github_output_without_the_variable_fails_cleanly(cli: CliRunner, tmp_path) -> None:
    result = cli.invoke(app, ["labels", str(write_row(tmp_path, ROW)), "--github-output"])
    assert result.exit_code == 2 and "GITHUB_OUTPUT" in result.stderr


# ---- node-count -------------------------------------------------------------------------------


def test_node_count_of_an_allocation_spec(cli: CliRunner, data: Path) -> None:
    result = cli.invoke(app, ["node-count", str(data / "allocation.yaml")])
    assert (result.exit_code, result.stdout.strip()) == (0, "3")
    result = cli.invoke(app, ["node-count", "--json", str(data / "allocation.yaml")])
    assert json.loads(result.stdout) == {"kind": "allocation", "node-count": 3}


def test_node_count_of_a_matrix_row_derived_with_a_hardware_table(
    cli: CliRunner, data: Path
) -> None:
    row = str(data / "row-disagg.yaml")
    result = cli.invoke(app, ["node-count", row, "--hardware", str(data / "hardware.yaml")])
    assert (result.exit_code, result.stdout.strip()) == (0, "3")
    # without the table the topology rule cannot know the GPUs per node: named, exit 2
    result = cli.invoke(app, ["node-count", row])
    assert result.exit_code == 2
    assert "cluster:b300-nv" in result.stderr and "hardware table" in result.stderr


def test_node_count_of_rows_with_explicit_and_empty_counts(cli: CliRunner, tmp_path: Path) -> None:
    result = cli.invoke(app, ["node-count", "--json", "-"], input=json.dumps(ROW))
    assert json.loads(result.stdout) == {"kind": "row", "node-count": 3}
    result = cli.invoke(app, ["node-count", "-"], input=json.dumps({**ROW, "node-count": ""}))
    assert result.exit_code == 0 and result.stdout.strip() == ""
    result = cli.invoke(app, ["node-count", "-"], input=json.dumps({"runner": "h100"}))
    assert result.stdout.strip() == "1"


def test_node_count_bad_allocation_spec_names_the_field(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: Bad_Name\nclient: {command: [echo]}\ndeployments: [{name: a, command: [x]}]\n"
    )
    result = cli.invoke(app, ["node-count", str(path)])
    assert result.exit_code == 2
    assert "name" in result.stderr and "lowercase" in result.stderr


# ---- properties -------------------------------------------------------------------------------

rows = st.fixed_dictionaries(
    {"runner": st.sampled_from(["cluster:h100", "cluster:B200-nv", "gb200"])},
    optional={
        "node-count": st.one_of(st.integers(1, 64), st.just(""), st.none()),
        "model-prefix": st.sampled_from(["dsr1", "kimik3", "other"]),
        "precision": st.sampled_from(["fp4", "fp8"]),
        "framework": st.sampled_from(["vllm", "sglang-x", "trt"]),
    },
)


@given(row=rows, priority=st.booleans(), node_slots=st.booleans(), attempt=st.integers(1, 9))
def test_label_set_properties(row: dict[str, Any], priority: bool, node_slots: bool, attempt: int):
    spec = spec_from_data(row, "row")
    result = compute_labels(spec, LabelFlags(priority, node_slots), RunContext(7, attempt))
    labels = list(result.runs_on)
    folded = [label.casefold() for label in labels]
    assert len(folded) == len(set(folded)), labels
    assert row["runner"] in labels
    has_nodes = any(label.startswith("nodes:") for label in labels)
    known = row.get("node-count") not in ("", None) or "node-count" not in row
    # nodes:N only with both flags on and a known count; then it is the row's count
    assert has_nodes == (priority and node_slots and known)
    if has_nodes:
        assert parse_nodes(labels) == result.nodes == (row.get("node-count") or 1)
    if not priority:
        assert labels == [row["runner"]]
    else:
        gate = JobLabel.parse(result.job_label or "")
        assert labels[0] == "self-hosted" and labels[-1] == f"ci-attempt-{attempt}"
        assert gate.score == Decimal(result.score or "")
        assert str(gate.score) == result.score  # the planner reads back exactly what was scored


def test_cli_reads_the_priority_weights_from_an_inferencex_policy_file(
    cli: CliRunner, tmp_path: Path
) -> None:
    seed = Path(__file__).resolve().parents[2] / "examples" / "github" / "ci-priority.yaml"
    row = write_row(tmp_path, ROW)
    args = ["labels", str(row), "--priority", "--run-id", "9", "--run-attempt", "1"]
    same = cli.invoke(app, [*args, "--priority-policy", str(seed)])
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["score"] == json.loads(cli.invoke(app, args).stdout)["score"]
    mine = tmp_path / "mine.yaml"
    mine.write_text(seed.read_text().replace("dsr1: 0.75", "dsr1: 2.0"))
    changed = cli.invoke(app, args, env={"SLURMGATE_PRIORITY_POLICY": str(mine)})
    assert json.loads(changed.stdout)["score"] == "2.998"  # 1 + 2.0 - 0.002
    mine.write_text("version: 2\n")
    refused = cli.invoke(app, [*args, "--priority-policy", str(mine)])
    assert refused.exit_code == 2
    assert "unsupported version 2" in refused.stderr and "Traceback" not in refused.output


RECIPES = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize(
    ("recipe", "nodes"),
    [
        ("inferencex-recipes-schema2/sglang/qwen3.5/gb200-fp8/8k1k/4p1d-dep4-dep16.yaml", 8),
        ("inferencex-recipes/sglang/glm5.2/gb200-fp4/agentic/agg-gb200-tp8-c2-mtp.yaml", 2),
    ],
)
def test_a_recipe_is_counted_as_a_recipe_not_as_a_one_node_row(recipe: str, nodes: int) -> None:
    """A recipe passed where a row or a spec goes would have been a one-node row and asked for
    nodes:1: an over-admission. It is recognised and counted as InferenceX counts it."""
    job = load_spec(RECIPES / recipe)
    assert (job.kind, resolve_node_count(job).value) == ("recipe", nodes)
    ran = CliRunner().invoke(app, ["node-count", str(RECIPES / recipe), "--json"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout) == {"kind": "recipe", "node-count": nodes}
    labels = compute_labels(job, LabelFlags(True, True), RUN, runner="cluster:gb200")
    assert f"nodes:{nodes}" in labels.runs_on


def test_a_document_that_is_neither_spec_recipe_nor_row_is_refused_by_name() -> None:
    with pytest.raises(CIError, match=r"doc: neither an allocation spec .* nor a matrix row"):
        spec_from_data({"workers": 18, "gpus": 72}, "doc")
    ran = CliRunner().invoke(app, ["node-count", "-"], input="workers: 18\n")
    assert ran.exit_code == 2 and "neither an allocation spec" in ran.output, ran.output
