"""AIPerf's agentic trace replay, planned as InferenceX's agentic_srt.sh runs it, per concurrency.

The argv is InferenceX's `build_replay_cmd` (benchmarks/benchmark_lib.sh at InferenceX commit
843c6254, which agentic_srt.sh calls once per concurrency): `aiperf profile --scenario
inferencex-agentx-mvp` against the endpoint's streamed chat completions, replaying a Weka trace
corpus, artifacts in `<results>/conc_<c>/aiperf_artifacts`. InferenceX runs its own AIPerf fork
(utils/aiperf); slurmgate runs AIPerf from PyPI (scripts/aiperf.txt), which holds the scenario
and the Weka loaders but not the fork's `--warmup-requests-per-lane`,
`--use-dynamo-conv-aware-routing` or `--dynamo-session-timeout-seconds`, and whose scenario
forbids InferenceX's `--trace-idle-gap-cap-seconds 300` (it keeps each trace's own timing):
those are left out. A local trace cannot prove which corpus it is, so the scenario takes it
only with `--unsafe-override` (AIPerf marks such a run not valid for submission).
AIPerf's defaults keep what InferenceX's agentic aggregate reads: the per-request export
(`profile_export.jsonl`) and the server metrics scraped from the URL's `/metrics`, plus the
engines' own endpoints named in AIPERF_SERVER_METRICS_URLS (passed as `--server-metrics`, as
build_replay_cmd does; the recipe's env, else the list a run hands its client): slurmgate's
endpoint exports no engine metric.
The corpus is a public loader's Hugging Face dataset (fetched first with `hf download`, as
InferenceX does) or a local Weka trace file or folder (`--custom-dataset-type weka_trace`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurmgate.errors import ExternalError, InputError

SCENARIO = "inferencex-agentx-mvp"
SCENARIO_MIN_DURATION = 900  # the scenario's minimum; shorter runs need --unsafe-override
# AIPerf's public Weka loaders and the Hugging Face dataset each replays: InferenceX's
# resolve_trace_source (benchmarks/benchmark_lib.sh, commit 843c6254).
CORPORA = {
    "semianalysis_cc_traces_weka_with_subagents": "semianalysisai/cc-traces-weka-061526",
    "semianalysis_cc_traces_weka_with_subagents_256k": "semianalysisai/cc-traces-weka-061526-256k",
    **{
        f"semianalysis_cc_traces_weka_with_subagents_{d}{s}": (
            f"semianalysisai/cc-traces-weka-with-subagents-{d}{s.replace('_', '-')}"
        )
        for d in ("060226", "060526", "060826")
        for s in ("", "_256k")
    },
    **{
        f"semianalysis_cc_traces_weka_{d}{s}": f"semianalysisai/cc-traces-weka-{d}"
        + s.replace("_", "-")
        for d in ("061326", "061526", "062126")
        for s in ("", "_256k")
    },
}
LONG_CONTEXT_PREFIXES = ("dsv4", "glm5.2", "minimaxm3", "kimik3")  # their default: the full corpus


class CorpusUnavailable(ExternalError):
    """The trace corpus a public loader names cannot be fetched here."""


def default_loader(model_prefix: str | None) -> str:
    """InferenceX's default corpus for a model family: 1M-token families the full one."""
    full = (model_prefix or "").startswith(LONG_CONTEXT_PREFIXES)
    return "semianalysis_cc_traces_weka_062126" + ("" if full else "_256k")


@dataclass(frozen=True)
class AgenticReplay:
    """One agentic benchmark: a trace corpus replayed at each concurrency for `duration` s."""

    url: str
    model: str
    tokenizer: str
    concurrencies: tuple[int, ...]
    duration: int = 1800
    loader: str | None = None
    input_file: Path | None = None
    failed_request_threshold: float = 0.10
    warmup_grace_period: int = 1800
    max_context_length: int | None = None
    num_dataset_entries: int = 393
    # Prometheus endpoints of the engines, scraped beside the URL's own /metrics: InferenceX's
    # AIPERF_SERVER_METRICS_URLS, whose export its agentic aggregate reads the cache figures from
    server_metrics_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.loader is None) == (self.input_file is None):
            raise InputError(
                "aiperf trace: give exactly one of --public-dataset LOADER or --input-file PATH"
            )
        if self.loader is not None and self.loader not in CORPORA:
            raise InputError(
                f"aiperf --public-dataset: {self.loader!r} is not one of InferenceX's Weka "
                f"loaders; use one of {', '.join(sorted(CORPORA))}"
            )
        if any(not u or any(c.isspace() for c in u) for u in self.server_metrics_urls):
            raise InputError(
                "AIPERF_SERVER_METRICS_URLS must be a comma-separated list of non-empty URLs"
            )
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise InputError(f"aiperf concurrencies: {self.concurrencies!r}: give counts of 1+")
        if self.duration < 1:
            raise InputError(f"aiperf duration: {self.duration}: give seconds, 1 or more")


@dataclass(frozen=True)
class AiperfStep:
    """One `aiperf profile` process: its concurrency, argv and artifact folder."""

    concurrency: int
    argv: tuple[str, ...]
    artifacts: Path


def server_metrics_urls(env: Mapping[str, str]) -> tuple[str, ...]:
    """AIPERF_SERVER_METRICS_URLS split as InferenceX's build_replay_cmd splits it (an empty
    item is kept, to be refused)."""
    items = env.get("AIPERF_SERVER_METRICS_URLS", "").split(",")
    if items[-1] == "":  # bash's `read -a` drops a trailing empty field
        items.pop()
    return tuple(items)


def trace_flags(r: AgenticReplay) -> list[str]:
    if r.loader is not None:
        return ["--public-dataset", r.loader]
    return ["--custom-dataset-type", "weka_trace", "--input-file", str(r.input_file)]


def plan(r: AgenticReplay, aiperf: str, results: Path) -> list[AiperfStep]:
    """One `aiperf profile` per concurrency, its artifacts in `<results>/conc_<c>/`."""
    steps = []
    for c in r.concurrencies:
        artifacts = results / f"conc_{c}" / "aiperf_artifacts"
        argv = [aiperf, "profile", "--scenario", SCENARIO, "--url", r.url]
        argv += ["--endpoint", "/v1/chat/completions", "--endpoint-type", "chat", "--streaming"]
        argv += ["--model", r.model, "--tokenizer", r.tokenizer, "--concurrency", str(c)]
        argv += ["--benchmark-duration", str(r.duration), "--stats-interval", "30"]
        argv += ["--random-seed", "42"]
        argv += ["--failed-request-threshold", str(r.failed_request_threshold)]
        argv += ["--trajectory-start-min-ratio", "0.25", "--trajectory-start-max-ratio", "0.75"]
        argv += ["--warmup-grace-period", str(r.warmup_grace_period)]
        argv += ["--use-server-token-count", "--no-gpu-telemetry"]
        argv.append("--tokenizer-trust-remote-code")
        if r.max_context_length:
            argv += ["--max-context-length", str(r.max_context_length)]
        argv += ["--num-dataset-entries", str(r.num_dataset_entries), "--slice-duration", "1.0"]
        if r.server_metrics_urls:
            argv += ["--server-metrics", *r.server_metrics_urls]
        argv += ["--output-artifact-dir", str(artifacts)]
        if r.duration < SCENARIO_MIN_DURATION or r.input_file is not None:
            argv.append("--unsafe-override")
        argv += trace_flags(r)
        steps.append(AiperfStep(c, tuple(argv), artifacts))
    return steps


# The environment AIPerf reads the way InferenceX's build_replay_cmd sets it.
REPLAY_ENV = {
    "AIPERF_DATASET_CONFIGURATION_TIMEOUT": "1800",
    "AIPERF_SERVICE_PROFILE_CONFIGURE_TIMEOUT": "1800",
    "AIPERF_UI_REALTIME_METRICS_ENABLED": "true",
}


def _offline(env: Mapping[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def corpus_probe(dataset: str, env: Mapping[str, str], timeout: float = 10.0) -> str | None:
    """Why the Hugging Face hub cannot serve `dataset` here, or None when it answers."""
    if _offline(env):
        return None  # `hf download` answers from the cache alone, at once
    hub = env.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        with urllib.request.urlopen(f"{hub}/api/datasets/{dataset}", timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return f"{hub} answered {exc.code} for dataset {dataset}"
    except (OSError, ValueError) as exc:
        return f"{hub} is out of reach ({getattr(exc, 'reason', exc)})"


def fetch_argv(hf: str, loader: str) -> list[str]:
    """InferenceX's pre-download of a loader's corpus into HF_HUB_CACHE."""
    return [hf, "download", "--repo-type", "dataset", CORPORA[loader]]


def unavailable(loader: str, why: str, env: Mapping[str, str]) -> CorpusUnavailable:
    mode = "HF_HUB_OFFLINE is set and " if _offline(env) else ""
    return CorpusUnavailable(
        f"aiperf corpus {loader} ({CORPORA[loader]}) cannot be fetched: {mode}{why}; "
        "put it in HF_HUB_CACHE beforehand or replay a local trace with --input-file"
    )


def write_stand_in_traces(folder: Path, model: str, count: int = 4, turns: int = 4) -> Path:
    """A small Weka trace corpus for a stand-in model (`--local`): the hub corpus's format (one
    JSON object per trace file: streamed turns with input and output lengths, KV block hash ids
    and think time), each turn's context growing as a coding session's does, short enough for
    a tiny model's context."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    block = 16
    for i in range(count):
        requests = [
            {
                "t": 0.5 * turn,
                "type": "s",
                "model": model,
                "in": 64 + 32 * turn,
                "out": 8,
                # turns of one trace share their prefix's blocks, as a session's do
                "hash_ids": list(range(100 * i, 100 * i + (64 + 32 * turn) // block)),
                "api_time": 0.2,
            }
            for turn in range(turns)
        ]
        trace = {
            "id": f"stand-in-{i}",
            "models": [model],
            "block_size": block,
            "hash_id_scope": "local",
            "requests": requests,
        }
        (folder / f"stand-in-{i}.json").write_text(json.dumps(trace))
    return folder
