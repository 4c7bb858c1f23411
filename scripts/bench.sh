#!/usr/bin/env bash
# Every benchmark at full size (`make bench`): setup, the bundled Slurm cluster if none answers.
#
#   scripts/bench.sh                              # all of benchmarks/bench_*.py, results in
#                                                 # benchmarks/results/ (about 20 minutes)
#   scripts/bench.sh --smoke --results-dir DIR    # the same, small (arguments go to each one)
#   scripts/bench.sh --list                       # the commands it would run, nothing else
#
# A benchmark that needs Slurm is skipped, with the reason, when no cluster answers and the
# bundled one cannot start (it needs root on Debian, as for `make test`). Exit status 1 when any
# benchmark failed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SLURMGATE_VENV:-.venv}"
NEEDS_SLURM=(benchmarks/bench_runtime.py)
benches=(benchmarks/bench_*.py)

if [ "${1:-}" = "--list" ]; then
    for bench in "${benches[@]}"; do echo "$VENV/bin/python $bench"; done
    exit 0
fi

scripts/setup.sh
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false

slurm_answers() { command -v sinfo >/dev/null 2>&1 && timeout 10 sinfo -h >/dev/null 2>&1; }

local_env="${SLURM_LOCAL_DIR:-/tmp/slurm-local}/env.sh"
if ! slurm_answers && [ -f "$local_env" ]; then
    # the bundled cluster may already be up without SLURM_CONF in this shell: use it, leave it up
    # shellcheck disable=SC1090
    . "$local_env"
    export SLURMGATE_LOCAL_SLURM=1
fi
started_slurm=0
slurm_missing=""
if ! slurm_answers; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log="${TMPDIR:-/tmp}/slurmgate-bench-slurm-start.log"
        if SLURM_LOCAL_MODE=netns scripts/slurm-local/start.sh >"$log" 2>&1; then
            started_slurm=1
            # shellcheck disable=SC1090
            . "$local_env"
            export SLURMGATE_LOCAL_SLURM=1
        else
            slurm_missing="scripts/slurm-local/start.sh failed (see $log)"
            tail -n 20 "$log" >&2 || true
        fi
    else
        slurm_missing="no sinfo answers, and starting the bundled cluster needs root on Debian"
    fi
fi
cleanup() {
    if [ "$started_slurm" = 1 ]; then scripts/slurm-local/stop.sh >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

failed=()
skipped=()
for bench in "${benches[@]}"; do
    if [ -n "$slurm_missing" ] && [[ " ${NEEDS_SLURM[*]} " == *" $bench "* ]]; then
        echo "== $bench: SKIPPED, $slurm_missing" >&2
        skipped+=("$bench")
        continue
    fi
    echo "== $VENV/bin/python $bench $*"
    started=$SECONDS
    if "$VENV/bin/python" "$bench" "$@"; then
        echo "== $bench: done in $((SECONDS - started)) s"
    else
        echo "== $bench: FAILED (exit $?) after $((SECONDS - started)) s" >&2
        failed+=("$bench")
    fi
done

echo "== benchmarks: ${#benches[@]} listed, ${#failed[@]} failed, ${#skipped[@]} skipped"
if [ ${#skipped[@]} -gt 0 ]; then echo "   skipped (no Slurm): ${skipped[*]}"; fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "   failed: ${failed[*]}" >&2
    exit 1
fi
