#!/bin/sh
# The official image's first start, as far as compose.yaml needs it: a cluster owned by POSTGRES_USER with
# POSTGRES_PASSWORD (scram over TCP), and POSTGRES_DB.
set -eu
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups /bin/sh "$0" "$@"
fi
user=${POSTGRES_USER:-postgres}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?}"
    pwfile=$(mktemp)
    printf '%s' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    pg_ctl -w -o "-c listen_addresses=''" start >/dev/null
    if [ -n "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --username="$user" --dbname=postgres -c "CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null
    fi
    pg_ctl -w -m fast stop >/dev/null
fi
if [ "$1" = postgres ]; then
    shift
    exec postgres -c listen_addresses='*' "$@"
fi
exec "$@"
