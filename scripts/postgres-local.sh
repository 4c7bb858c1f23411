#!/usr/bin/env bash
# A throw-away PostgreSQL for a Prefect server: start|stop|url|status on a loopback port.
#
#   scripts/postgres-local.sh start   # installs Debian's postgresql if missing (as root), runs a
#                                     # fresh cluster in $SLURMGATE_PG_DIR, prints the asyncpg URL
#   export PREFECT_SERVER_DATABASE_CONNECTION_URL="$(scripts/postgres-local.sh url)"
#   scripts/postgres-local.sh stop    # stops it and removes the directory
#
# Settings (environment):
#   SLURMGATE_PG_DIR   the cluster's directory (default: ${TMPDIR:-/tmp}/slurmgate-postgres); it
#                      must sit where the `postgres` user can reach it when run as root
#   SLURMGATE_PG_PORT  the port on 127.0.0.1 (default: a free port, kept in the directory)
#   SLURMGATE_PG_DB    the database to create (default: prefect)
# start and stop are idempotent: start on a running cluster creates SLURMGATE_PG_DB if it is
# new and prints its URL, stop on a stopped one does nothing. Trust authentication on loopback only: never expose the port.
set -euo pipefail

DIR="${SLURMGATE_PG_DIR:-${TMPDIR:-/tmp}/slurmgate-postgres}"
DB="${SLURMGATE_PG_DB:-prefect}"
DATA="$DIR/data"
LOG="$DIR/postgres.log"

die() { echo "postgres-local: $*" >&2; exit 1; }

[[ "$DB" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] \
    || die "SLURMGATE_PG_DB=$DB is not a plain database name; use letters, digits and _ only"

pg_bin() {
    local bin
    bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)"
    [ -n "$bin" ] && [ -x "$bin/initdb" ] && echo "$bin"
}

install_postgres() {
    [ -n "$(pg_bin)" ] && return 0
    [ "$(id -u)" = 0 ] || die "PostgreSQL is not installed; run this as root (it apt-get installs \
Debian's postgresql) or install the postgresql package yourself"
    command -v apt-get >/dev/null 2>&1 || die "no apt-get: install PostgreSQL (initdb, pg_ctl) \
so that /usr/lib/postgresql/<version>/bin exists"
    echo "postgres-local: apt-get install postgresql" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql \
        >/dev/null
    [ -n "$(pg_bin)" ] || die "postgresql installed but no /usr/lib/postgresql/*/bin/initdb"
    # The package may have started its own `main` cluster on 5432; we just created it and run
    # our own, so stop it rather than leave a server behind.
    if command -v pg_lsclusters >/dev/null 2>&1; then
        pg_lsclusters -h 2>/dev/null | awk '$4 == "online" {print $1, $2}' \
            | while read -r ver name; do pg_ctlcluster "$ver" "$name" stop || true; done
    fi
}

# Run a PostgreSQL binary as the cluster's owner: `postgres` when we are root (initdb refuses
# root), ourselves otherwise.
as_owner() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

url() {
    echo "postgresql+asyncpg://postgres@127.0.0.1:$(cat "$DIR/port")/$DB"
}

running() {
    local bin
    bin="$(pg_bin)" || return 1
    [ -f "$DATA/PG_VERSION" ] && as_owner "$bin/pg_ctl" -D "$DATA" status >/dev/null 2>&1
}

start() {
    install_postgres
    local bin port
    bin="$(pg_bin)"
    if ! running; then
        mkdir -p "$DIR"
        [ "$(id -u)" = 0 ] && chown postgres: "$DIR"
        chmod 700 "$DIR"
        if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -w "$DIR"; then
            rmdir "$DIR" 2>/dev/null || true
            die "the postgres user cannot reach $DIR (a parent directory is private); set \
SLURMGATE_PG_DIR to a path under a world-searchable directory such as /tmp"
        fi
        if [ ! -f "$DATA/PG_VERSION" ]; then
            as_owner "$bin/initdb" -D "$DATA" -U postgres --auth=trust --encoding=UTF8 \
                --no-locale >"$DIR/initdb.log" 2>&1 \
                || die "initdb failed; see $DIR/initdb.log"
        fi
        port="${SLURMGATE_PG_PORT:-$(cat "$DIR/port" 2>/dev/null || free_port)}"
        echo "$port" >"$DIR/port"
        as_owner "$bin/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $port -k $DIR -c max_connections=200" start \
            >/dev/null || die "pg_ctl start failed on port $port; see $LOG (set \
SLURMGATE_PG_PORT to a free port if it is taken)"
    fi
    # On a running cluster too: another SLURMGATE_PG_DB gets its own fresh database.
    port="$(cat "$DIR/port")"
    if ! as_owner "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$DB'" postgres | grep -q 1; then
        as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres "$DB"
    fi
    url
}

stop() {
    local bin
    bin="$(pg_bin)" || true
    if [ -n "${bin:-}" ] && running; then
        as_owner "$bin/pg_ctl" -D "$DATA" -m fast -w -t 60 stop >/dev/null
    fi
    rm -rf "$DIR"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    url) running || die "not running; run: $0 start"; url ;;
    status) if running; then echo "running: $(url)"; else echo "stopped"; exit 3; fi ;;
    *) die "usage: $0 start|stop|url|status (SLURMGATE_PG_DIR, SLURMGATE_PG_PORT, SLURMGATE_PG_DB)" ;;
esac
