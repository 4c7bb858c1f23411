"""`slurmgate loadgen`: the client workload's load generator, as a command the client runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from slurmgate.cli.common import fail
from slurmgate.settings.handed import ENDPOINT_TOKEN, ENDPOINTS, handed

app = typer.Typer()


@app.command(
    "loadgen",
    epilog=(
        "Example: slurmgate loadgen http://127.0.0.1:17000 --concurrency 32 --duration 10 "
        "--json\n\nExample: slurmgate loadgen http://127.0.0.1:17000 --chat --rate 4 "
        "--prompt-tokens uniform:64,512 --output-tokens lognormal:128,64 --duration 60"
    ),
)
def loadgen(
    url: Annotated[str, typer.Argument(help="Base URL of an endpoint, e.g. http://HOST:PORT.")],
    path: Annotated[
        str | None,
        typer.Option(
            help="Request path (default /v1/completions, with --chat /v1/chat/completions).",
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 8,
    duration: Annotated[float | None, typer.Option(help="Seconds to run (default 10).")] = None,
    requests: Annotated[int | None, typer.Option(help="Stop after this many requests.")] = None,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each completion.")] = 16,
    model: Annotated[str, typer.Option(help="Model name sent in each request.")] = "stub-model",
    stream: Annotated[bool, typer.Option(help="Ask for SSE streaming.")] = False,
    honour_retry_after: Annotated[
        bool, typer.Option(help="Wait a 429's Retry-After before the next request.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="Streaming chat mode: TTFT, inter-token and end-to-end latency, tokens/s.",
        ),
    ] = False,
    rate: Annotated[
        float | None,
        typer.Option(
            help="With --chat: requests per second (open loop) instead of a concurrency.",
            show_default=False,
        ),
    ] = None,
    arrivals: Annotated[
        str, typer.Option(help="With --rate: poisson or constant gaps between requests.")
    ] = "poisson",
    prompt_tokens: Annotated[
        str,
        typer.Option(
            help="With --chat: prompt length in tokens: N, uniform:LO,HI, normal:MEAN,STD "
            "or lognormal:MEAN,STD."
        ),
    ] = "32",
    output_tokens: Annotated[
        str | None,
        typer.Option(
            help="With --chat: output length (max_tokens), same forms (default --max-tokens).",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="With --chat: seed of lengths and arrivals.")] = 0,
    label: Annotated[
        str | None,
        typer.Option(
            help="With --chat: the report's name (default the deployment the URL belongs to).",
            show_default=False,
        ),
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option(
            help="With --chat: also write the JSON report here (inside an allocation it goes "
            "to the run's reports directory, which the flow publishes).",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            help="With --chat: seconds one request may take in all (a minute of silence "
            "mid-stream also ends it)."
        ),
    ] = 300.0,
) -> None:
    """Drive an endpoint at a set concurrency; report throughput, latency percentiles and 429s.

    With --chat it streams chat completions at a concurrency or a request rate, with prompt and
    output lengths drawn from a distribution, and reports what users measure.
    """
    import asyncio
    import json

    from slurmgate.runtime.loadgen.completions import LoadSpec, run_load

    if not url.startswith(("http://", "https://")):
        raise fail(f"URL {url!r} is not an http(s) URL; e.g. http://127.0.0.1:17000")
    if chat:
        _chat_load(
            url,
            path=path,
            concurrency=concurrency,
            duration=duration,
            requests=requests,
            model=model,
            honour_retry_after=honour_retry_after,
            as_json=as_json,
            rate=rate,
            arrivals=arrivals,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens if output_tokens is not None else str(max_tokens),
            seed=seed,
            label=label,
            report=report,
            timeout=timeout,
        )
        return
    for name, value in (("--rate", rate), ("--label", label), ("--report", report)):
        if value is not None:
            raise fail(f"{name} belongs to the streaming chat mode; add --chat")
    spec = LoadSpec(
        url=url,
        path=path or "/v1/completions",
        concurrency=concurrency,
        duration=duration if duration is not None or requests is not None else 10.0,
        requests=requests,
        body={"model": model, "prompt": "hello", "max_tokens": max_tokens}
        | ({"stream": True} if stream else {}),
        honour_retry_after=honour_retry_after,
    )
    try:
        spec.check()
    except ValueError as exc:
        raise fail(f"{exc}") from None
    result = asyncio.run(run_load(spec))
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(
            f"{result.ok} ok, {result.throttled} throttled (429), "
            f"errors {result.errors or 'none'} in {result.elapsed:.2f}s: "
            f"{result.throughput:.0f} req/s, p50 {result.latency_p50 * 1e3:.2f} ms, "
            f"p99 {result.latency_p99 * 1e3:.2f} ms"
        )
    if not result.ok:
        raise typer.Exit(code=1)


def _chat_load(
    url: str,
    *,
    path: str | None,
    concurrency: int,
    duration: float | None,
    requests: int | None,
    model: str,
    honour_retry_after: bool,
    as_json: bool,
    rate: float | None,
    arrivals: str,
    prompt_tokens: str,
    output_tokens: str,
    seed: int,
    label: str | None,
    report: Path | None,
    timeout: float,
) -> None:
    """`loadgen --chat`: run, print the table (or JSON), write the report where asked."""
    import asyncio
    import json

    from slurmgate.runtime.loadgen.chat import run_chat_load
    from slurmgate.runtime.loadgen.report import label_for, report_path_in, write_report
    from slurmgate.runtime.loadgen.workload import ChatLoadSpec, Lengths, LoadInputError

    token = handed(ENDPOINT_TOKEN)  # from the runtime, never argv
    try:
        spec = ChatLoadSpec(
            url=url,
            model=model,
            path=path or "/v1/chat/completions",
            concurrency=concurrency,
            rate=rate,
            arrivals=arrivals,
            duration=duration if duration is not None or requests is not None else 10.0,
            requests=requests,
            prompt_tokens=Lengths.parse(prompt_tokens, "--prompt-tokens"),
            output_tokens=Lengths.parse(output_tokens, "--output-tokens"),
            seed=seed,
            honour_retry_after=honour_retry_after,
            label=label or label_for(url, handed(ENDPOINTS)),
            headers={"authorization": f"Bearer {token}"} if token else {},
            timeout=timeout,
            idle_timeout=min(timeout, 60.0),
        )
        spec.check()
    except LoadInputError as exc:
        raise fail(str(exc)) from None
    result = asyncio.run(run_chat_load(spec))
    targets = [report] if report is not None else []
    from slurmgate.runtime.run.client import CLIENT_REPORTS_ENV

    reports_dir = handed(CLIENT_REPORTS_ENV)
    if reports_dir:
        targets.append(report_path_in(Path(reports_dir), spec.label))
    for target in targets:
        try:
            write_report(result, target)
        except OSError as exc:
            raise fail(f"cannot write the report to {target}: {exc.strerror or exc}") from None
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.render())
    if not result.ok:
        raise typer.Exit(code=1)
