#!/bin/sh
# Rolls a compose deployment (compose.yaml) onto a new release, one container at a time, nothing lost:
#
#   APP_IMAGE=hitl-console:2 deploy/rollout.sh
#   COMPOSE=podman-compose ENGINE=podman APP_IMAGE=hitl-console:2 deploy/rollout.sh      (Podman)
#
# 1. The new release's migrations, first: expand only (docs/deploy.md, "Migrations under a rolling deploy"), so
#    the previous release's code, still running, works on the new schema.
# 2. The workers, one at a time, before the web (new web code may defer tasks only new workers know): SIGTERM,
#    then up to the stop grace period for its running steps (a step still running then is recovered by another
#    worker after STALLED_AFTER_SECONDS: never lost, never done twice); then its replacement on the new image,
#    healthy (its heartbeat) before the next one stops.
# 3. The web replicas, one at a time: the others answer meanwhile (HAProxy takes a stopping replica out and
#    sends a request it could not connect to on to another); a replacement answers /healthz and has been seen
#    by HAProxy before the next one stops.
#
# COMPOSE_PROJECT_NAME: the stack's project (default hitl-console, compose.yaml's name). The grace periods are
# compose.yaml's: WORKER_STOP_GRACE_PERIOD (default 30s) and the web's 75 s.
set -eu
: "${APP_IMAGE:?name the new release: APP_IMAGE=hitl-console:2 $0}"
export APP_IMAGE
COMPOSE=${COMPOSE:-docker compose}
ENGINE=${ENGINE:-docker}
PROJECT=${COMPOSE_PROJECT_NAME:-hitl-console}
WORKER_GRACE=${WORKER_STOP_GRACE_PERIOD:-30s}
WORKER_GRACE=${WORKER_GRACE%s}
WEB_GRACE=75
HEALTHY_WITHIN=${HEALTHY_WITHIN:-180}
PROXY_SETTLE=${PROXY_SETTLE:-3}

say() { printf '%s rollout: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

containers() {
    $ENGINE ps --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | sort
}

# $1: a container; the rest: the command that says it is healthy.
wait_healthy() {
    container=$1
    shift
    waited=0
    until $ENGINE exec "$container" "$@" >/dev/null 2>&1; do
        waited=$((waited + 1))
        if [ "$waited" -ge "$HEALTHY_WITHIN" ]; then
            say "$container is not healthy after $HEALTHY_WITHIN s: stopping the rollout here"
            exit 1
        fi
        sleep 1
    done
}

# $1: a service; $2: its stop grace period in seconds; $3: seconds to let a healthy replacement settle (HAProxy
# finds a web replica within about 2 s); the rest: its health command.
replace_each() {
    service=$1
    grace=$2
    settle=$3
    shift 3
    olds=$(containers "$service")
    [ -n "$olds" ] || { say "no $service container is running in project $PROJECT"; exit 1; }
    for old in $olds; do
        say "$service: stopping $old (SIGTERM, up to $grace s)"
        $ENGINE stop -t "$grace" "$old" >/dev/null
        $ENGINE rm "$old" >/dev/null
        before=$(containers "$service")
        $COMPOSE up -d --no-deps --no-recreate "$service" >/dev/null 2>&1
        new=$(containers "$service" | grep -vxF "$before" || true)
        [ -n "$new" ] || { say "$service: no replacement for $old started"; exit 1; }
        wait_healthy "$new" "$@"
        sleep "$settle"
        say "$service: $new is up on $APP_IMAGE"
    done
}

say "migrations of $APP_IMAGE"
$COMPOSE run --rm --no-deps migrate
replace_each worker "$WORKER_GRACE" 0 python -m jobs.healthcheck
replace_each web "$WEB_GRACE" "$PROXY_SETTLE" python -m console.healthcheck
say "done: every worker and web replica runs $APP_IMAGE"
