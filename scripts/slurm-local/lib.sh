# lib.sh -- sourced by start.sh and stop.sh; not run on its own.

# pid_of PIDFILE NEEDLE -> prints the pid in the file when it is a live (non-zombie)
# process whose command line contains NEEDLE (guards against recycled pids).
pid_of() {
    local f="$1" needle="$2" pid
    [ -s "$f" ] || return 1
    pid=$(tr -dc 0-9 < "$f")
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null && return 1
    local cmd; cmd=$(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline") || return 1
    [[ "$cmd" == *"$needle"* ]] || return 1
    echo "$pid"
}

# pid_alive PIDFILE NEEDLE: pid_of without the output.
pid_alive() { pid_of "$@" >/dev/null; }
