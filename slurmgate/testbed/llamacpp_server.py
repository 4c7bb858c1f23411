"""llama.cpp's HTTP server in the foreground, from `llama-server`-style flags, through xllamacpp.

``xllamacpp`` (a test dependency: the ``dev`` extra) ships llama.cpp's native server as a prebuilt
CPU wheel but no command line, so this module is one: ``python -m slurmgate.testbed.llamacpp_server
-m MODEL.gguf --host H --port P --metrics [-c N] [-np N] [-t N]``. The flags keep ``llama-server``'s
names and meanings (https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md), so a
deployment with ``engine: llamacpp`` runs it exactly like the real binary, and the server is
llama.cpp's own: /health (503 while the model loads), /v1/models, /v1/completions,
/v1/chat/completions with SSE, /metrics and /slots.

It stays in the foreground until SIGTERM or SIGINT, then stops the server and exits 0; a model
that does not load exits 1 with one line on stderr. No prefect, no slurmgate runtime imports.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

MODULE = "slurmgate.testbed.llamacpp_server"
PROG = f"python -m {MODULE}"


def launch_command(
    model: Path | str,
    *,
    parallel: int = 1,
    ctx_size: int = 512,
    threads: int = 1,
    python: str = "python",
) -> list[str]:
    """A deployment's `command` for this server (``engine: llamacpp`` appends --host, --port and
    --metrics); add them yourself to run it by hand."""
    return [
        python, "-m", MODULE, "-m", str(model),
        "-np", str(parallel), "-c", str(ctx_size), "-t", str(threads),
    ]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The `llama-server` flags this launcher understands (a subset, same spelling)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="path of the GGUF model")
    p.add_argument("-a", "--alias", default=None, help="model name /v1/models lists")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--metrics", action="store_true", help="serve Prometheus /metrics")
    p.add_argument("--no-slots", action="store_true", help="do not serve /slots")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (0: the model's)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests run at once")
    p.add_argument(
        "-n", "--n-predict", type=int, default=-1, help="default max tokens (-1: no cap)"
    )
    p.add_argument("-t", "--threads", type=int, default=-1, help="CPU threads (-1: llama.cpp's)")
    p.add_argument("-tb", "--threads-batch", type=int, default=-1)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("--no-mmap", action="store_true", help="read the model instead of mapping it")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("-s", "--seed", type=int, default=None)
    p.add_argument("-lv", "--verbosity", type=int, default=3, help="log level (3: info)")
    return p


def server_params(args: argparse.Namespace) -> Any:
    """xllamacpp's CommonParams for the parsed flags (llama-server's fields of the same name)."""
    import xllamacpp  # type: ignore[import-untyped]  # a compiled module without stubs

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    if args.alias:
        params.model_alias = {args.alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.endpoint_metrics = args.metrics
    params.endpoint_slots = not args.no_slots
    params.n_ctx = args.ctx_size
    params.n_parallel = args.parallel
    params.n_predict = args.n_predict
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = (
        args.threads_batch if args.threads_batch > 0 else args.threads
    )
    params.n_batch = args.batch_size
    params.n_ubatch = args.ubatch_size
    if args.no_mmap:
        params.load_mode = xllamacpp.llama_load_mode.LLAMA_LOAD_MODE_NONE
    params.warmup = not args.no_warmup
    if args.seed is not None:
        params.sampling.seed = args.seed
    params.verbosity = args.verbosity
    return params


def _fail(message: str) -> None:
    print(f"llamacpp_server: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    """Start the server, wait for SIGTERM/SIGINT, stop it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: give a TCP port from 1 to 65535")
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: give at least 1 slot")
    if not Path(args.model).is_file():
        parser.error(f"--model {args.model}: no such file; give the path of a GGUF model")
    # llama.cpp colours its log on a terminal (srun's output can be one); lane logs are files.
    os.environ.setdefault("NO_COLOR", "1")
    try:
        import xllamacpp  # type: ignore[import-untyped]
    except ImportError:
        _fail("xllamacpp is not installed; install the dev extra: pip install -e '.[dev]'")
    params = server_params(args)
    # Until the server exists a signal keeps its default action (the process ends at once):
    # the constructor loads the model without returning to Python, so a handler could not run.
    try:
        server = xllamacpp.Server(params)
    except Exception as exc:  # the binding raises RuntimeError and friends for a failed load
        _fail(f"the server did not start: {type(exc).__name__}: {exc}")
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(
        f"llamacpp_server: serving {args.model} on {server.listening_address}",
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    del server  # its destructor stops llama.cpp's loop and HTTP threads
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
