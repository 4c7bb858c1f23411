# shellcheck shell=bash
# Sourced by scripts/setup.sh and scripts/demo.sh: run one slow step under a line that says so,
# so that a newcomer never watches a silent terminal for longer than a few seconds.

# with_progress WHAT COMMAND...: print "WHAT…" on stderr, then " N s…" every 5 s on a terminal,
# then " done in N s" (or " failed after N s"); returns the command's exit code.
with_progress() {
    local what="$1" started ticker="" rc=0
    shift
    started=$(date +%s)
    printf '%s…' "$what" >&2
    if [ -t 2 ]; then
        (while sleep 5; do printf ' %d s…' $(($(date +%s) - started)) >&2; done) &
        ticker=$!
    fi
    "$@" || rc=$?
    if [ -n "$ticker" ]; then
        kill "$ticker" 2>/dev/null || true
        wait "$ticker" 2>/dev/null || true
    fi
    if [ "$rc" = 0 ]; then
        printf ' done in %d s\n' $(($(date +%s) - started)) >&2
    else
        printf ' failed after %d s\n' $(($(date +%s) - started)) >&2
    fi
    return "$rc"
}
