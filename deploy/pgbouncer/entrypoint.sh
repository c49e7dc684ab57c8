#!/bin/sh
# Writes PgBouncer's configuration from the environment, then runs it in the foreground. The password stays in
# the container's memory and /tmp (never in the image).
set -eu
: "${DB_HOST:?}" "${DB_NAME:?}" "${DB_USER:?}" "${DB_PASSWORD:?}"
conf=$(mktemp -d)
umask 077
printf '"%s" "%s"\n' "$DB_USER" "$DB_PASSWORD" >"$conf/userlist.txt"
cat >"$conf/pgbouncer.ini" <<INI
[databases]
${DB_NAME}_tx = host=${DB_HOST} port=${DB_PORT:-5432} dbname=${DB_NAME} pool_mode=transaction pool_size=${PGBOUNCER_WEB_POOL_SIZE:-20}
${DB_NAME} = host=${DB_HOST} port=${DB_PORT:-5432} dbname=${DB_NAME} pool_mode=session pool_size=${PGBOUNCER_SESSION_POOL_SIZE:-60}

[pgbouncer]
listen_addr = 0.0.0.0
listen_port = 6432
auth_type = scram-sha-256
auth_file = ${conf}/userlist.txt
max_client_conn = ${PGBOUNCER_MAX_CLIENT_CONN:-500}
; A session pool needs workers x (WORKER_POOL_SIZE + 1 + WORKER_CONCURRENCY) server connections (pool_size above).
server_reset_query = DISCARD ALL
client_idle_timeout = 0
idle_transaction_timeout = 0
; Django asks for TCP keepalives in \`options\`, which PgBouncer cannot pass on; it probes the clients itself.
ignore_startup_parameters = options
tcp_keepalive = 1
tcp_keepidle = 10
tcp_keepintvl = 5
tcp_keepcnt = 3
INI
exec pgbouncer "$conf/pgbouncer.ini"
