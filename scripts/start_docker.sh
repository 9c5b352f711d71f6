#!/usr/bin/env bash
# Make a Docker engine and docker compose available; idempotent (does nothing when `docker info` answers).
#
# Installs Debian's docker.io (and docker-compose, the v1 tool, where no `docker compose` plugin exists), starts
# dockerd in the background with its log in $DOCKERD_LOG, and waits up to $DOCKER_WAIT_S for `docker info`.
# Needs root. Environment: DOCKERD_LOG (/var/log/dockerd.log), DOCKER_WAIT_S (60).
set -euo pipefail

DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
DOCKER_WAIT_S=${DOCKER_WAIT_S:-60}

log() { printf '[start_docker %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

apt_install() {
    if [[ -z ${_apt_updated:-} ]]; then
        apt-get update -qq
        _apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if ! command -v dockerd >/dev/null; then
    log "installing docker.io"
    apt_install docker.io
fi
if ! command -v docker >/dev/null; then
    apt_install docker-cli 2>/dev/null || apt_install docker.io
fi
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
    log "no docker compose plugin: installing Debian's docker-compose"
    apt_install docker-compose-v2 2>/dev/null || apt_install docker-compose
fi

if docker info >/dev/null 2>&1; then
    log "engine already running: $(docker info -f '{{.ServerVersion}}')"
    exit 0
fi

if ! pgrep -x dockerd >/dev/null; then
    log "starting dockerd (log: $DOCKERD_LOG)"
    mkdir -p "$(dirname "$DOCKERD_LOG")"
    # setsid: the engine outlives this script and is not in its process group
    setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
fi
for _ in $(seq 1 "$DOCKER_WAIT_S"); do
    if docker info >/dev/null 2>&1; then
        log "engine ready: $(docker info -f '{{.ServerVersion}}'), compose: $(
            docker compose version --short 2>/dev/null || docker-compose version --short 2>/dev/null || echo none
        )"
        exit 0
    fi
    sleep 1
done
log "dockerd did not answer within $DOCKER_WAIT_S s; last lines of $DOCKERD_LOG:"
tail -n 30 "$DOCKERD_LOG" >&2
exit 1
