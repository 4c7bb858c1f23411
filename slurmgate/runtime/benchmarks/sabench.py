"""srt-slurm's sa-bench client, planned as its bench.sh runs it: per concurrency a warmup, a run.

The arguments are bench.sh's (slurmgate/data/sa-bench/bench.sh, at the commit SOURCE.md names):
`benchmark_serving.py` with the `dynamo` backend on `/v1/completions`, the random dataset of
`isl`/`osl` tokens (range ratio 0.8) drawn with the model's tokenizer, `--ignore-eos`, and
`concurrency × num_warmup_mult` warmup prompts at 250 requests/s, then `concurrency ×
num_prompts_mult` prompts at `req_rate`, saved as bench.sh names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from slurmgate.errors import InputError

SCRIPT_DIR = Path(__file__).resolve().parents[2] / "data" / "sa-bench"
SCRIPT = SCRIPT_DIR / "benchmark_serving.py"
WARMUP_RATE = "250"  # bench.sh's warmup request rate
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"


@dataclass(frozen=True)
class SaBench:
    """One sa-bench benchmark: a recipe's `benchmark:` of type sa-bench, on one endpoint."""

    url: str
    model: str
    tokenizer: str
    isl: int
    osl: int
    concurrencies: tuple[int, ...]
    req_rate: str = "inf"
    random_range_ratio: float = 0.8
    num_prompts_mult: int = 10
    num_warmup_mult: int = 2
    use_chat_template: bool = True
    custom_tokenizer: str | None = None
    total_gpus: int = 0
    prefill_gpus: int = 0
    decode_gpus: int = 0
    disaggregated: bool = False

    def __post_init__(self) -> None:
        for field, value in (("isl", self.isl), ("osl", self.osl)):
            if value < 1:
                raise InputError(f"sa-bench {field}: {value} is not a token count; give 1 or more")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise InputError(
                f"sa-bench concurrencies: {self.concurrencies!r}: give one or more counts of 1 "
                "or more, e.g. 4x8x16"
            )
        if self.num_prompts_mult < 1 or self.num_warmup_mult < 0:
            raise InputError(
                "sa-bench num_prompts_mult must be 1 or more and num_warmup_mult 0 or more"
            )
        if urlsplit(self.url).scheme not in ("http", "https") or not urlsplit(self.url).hostname:
            raise InputError(f"sa-bench url: {self.url!r}: give the endpoint as http://HOST:PORT")


@dataclass(frozen=True)
class SaBenchStep:
    """One process of the plan: a warmup or a saved run at one concurrency."""

    concurrency: int
    warmup: bool
    argv: tuple[str, ...]
    saved: Path | None


def result_folder(b: SaBench) -> str:
    """bench.sh's result folder for the random dataset."""
    return f"sa-bench_isl_{b.isl}_osl_{b.osl}"


def result_filename(b: SaBench, concurrency: int) -> str:
    """bench.sh's result file of one concurrency."""
    if b.disaggregated:
        return (
            f"results_concurrency_{concurrency}_gpus_{b.total_gpus}_ctx_{b.prefill_gpus}"
            f"_gen_{b.decode_gpus}.json"
        )
    return f"results_concurrency_{concurrency}_gpus_{b.total_gpus}.json"


def parse_concurrencies(text: str) -> tuple[int, ...]:
    """srt-slurm's `4x8x16` (or a single count) as counts."""
    try:
        found = tuple(int(c) for c in str(text).split("x") if c.strip())
    except ValueError:
        found = ()
    if not found or min(found) < 1:
        raise InputError(f"concurrencies: {text!r} is not a list of counts; write them as 4x8x16")
    return found


def _target(b: SaBench) -> list[str]:
    parts = urlsplit(b.url)
    if parts.scheme == "https":
        return ["--base-url", b.url.rstrip("/")]
    return ["--host", str(parts.hostname), "--port", str(parts.port or 80)]


def _common(b: SaBench, python: str, num_prompts: int, concurrency: int) -> list[str]:
    argv = [python, "-u", str(SCRIPT), "--model", b.model, "--tokenizer", b.tokenizer]
    argv += [*_target(b), "--backend", "dynamo", "--endpoint", "/v1/completions"]
    argv += ["--disable-tqdm", "--dataset-name", "random", "--num-prompts", str(num_prompts)]
    argv += ["--random-input-len", str(b.isl), "--random-output-len", str(b.osl)]
    argv += ["--random-range-ratio", str(b.random_range_ratio), "--random-num-workers", "0"]
    return argv


def _tail(b: SaBench, concurrency: int) -> list[str]:
    argv = ["--percentile-metrics", PERCENTILE_METRICS, "--max-concurrency", str(concurrency)]
    argv.append("--trust-remote-code")
    if b.use_chat_template:
        argv.append("--use-chat-template")
    if b.custom_tokenizer:
        argv += ["--custom-tokenizer", b.custom_tokenizer]
    return argv


def plan(b: SaBench, python: str, results: Path) -> list[SaBenchStep]:
    """Every process bench.sh would start, in its order, saving into `results`."""
    folder = results / result_folder(b)
    steps = []
    for c in b.concurrencies:
        if b.num_warmup_mult > 0:
            argv = _common(b, python, c * b.num_warmup_mult, c)
            argv += ["--ignore-eos", "--request-rate", WARMUP_RATE, *_tail(b, c)]
            steps.append(SaBenchStep(c, True, tuple(argv), None))
        argv = _common(b, python, c * b.num_prompts_mult, c)
        argv += ["--ignore-eos", "--request-rate", b.req_rate, *_tail(b, c)]
        name = result_filename(b, c)
        argv += ["--save-result", "--result-dir", str(folder), "--result-filename", name]
        steps.append(SaBenchStep(c, False, tuple(argv), folder / name))
    return steps
