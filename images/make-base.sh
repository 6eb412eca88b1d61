#!/usr/bin/env bash
# Make the OS base image the trainpod images build on (`make base`).
#
#   1. If IMAGE already exists: nothing to do (`make clean-images` to start again).
#   2. If PUBLIC_BASE (debian:bookworm-slim) can be pulled: tag it IMAGE. The Dockerfile then
#      apt-installs the OS packages.
#   3. Otherwise (no registry): bootstrap Debian locally with debootstrap --variant=minbase,
#      including the packages of OS_PACKAGES_FILE so that the image build needs no apt at all, and
#      `docker import` it as IMAGE. The image gets the project's own name, never an official one.
#
# Settings (environment; the Makefile passes them): IMAGE, PUBLIC_BASE, SUITE, MIRROR,
# OS_PACKAGES_FILE (images/os-packages.txt: one package a line, # comments), ROOTFS (scratch
# directory, removed afterwards), DOCKER.
set -euo pipefail

IMAGE=${IMAGE:-trainpod-base:bookworm}
PUBLIC_BASE=${PUBLIC_BASE:-debian:bookworm-slim}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
OS_PACKAGES_FILE=${OS_PACKAGES_FILE:-$(dirname "${BASH_SOURCE[0]}")/os-packages.txt}
ROOTFS=${ROOTFS:-build/rootfs-$SUITE}
DOCKER=${DOCKER:-docker}

log() { echo "make-base: $*" >&2; }
die() { log "error: $*"; exit 1; }

# debootstrap --include= wants them comma-separated (install-os-packages.sh reads the file the same way)
OS_PACKAGES=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$OS_PACKAGES_FILE" | paste -sd, -)
[ -n "$OS_PACKAGES" ] || die "no packages in $OS_PACKAGES_FILE"

if "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE exists already (make clean-images to rebuild it)"
    exit 0
fi

if timeout 120 "$DOCKER" pull "$PUBLIC_BASE"; then
    "$DOCKER" tag "$PUBLIC_BASE" "$IMAGE"
    log "$IMAGE = $PUBLIC_BASE (pulled)"
    exit 0
fi

log "cannot pull $PUBLIC_BASE: bootstrapping Debian $SUITE locally with debootstrap"
command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] \
    || die "debootstrap is missing (apt-get install debootstrap, or run .ci/provision.sh)"
SUDO=
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || die "debootstrap needs root (or sudo)"
    SUDO=sudo
fi
export PATH="$PATH:/usr/sbin:/sbin"

# Remove the rootfs whatever happens; unmount first anything debootstrap left mounted in it
# (/proc, /sys after a failure), and never cross into another filesystem.
cleanup() {
    [ -d "$ROOTFS" ] || return 0
    local root
    root=$(realpath "$ROOTFS")
    awk -v r="$root/" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r \
        | while read -r mnt; do $SUDO umount -l "$mnt" || true; done
    $SUDO rm -rf --one-file-system "$ROOTFS"
}
trap cleanup EXIT
cleanup
mkdir -p "$(dirname "$ROOTFS")"

start=$SECONDS
$SUDO debootstrap --variant=minbase --include="$OS_PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR"

# Like the official slim image: updates and security sources for later apt-get installs, no
# package caches or lists, no docs or man pages now or from later installs, no host resolv.conf.
$SUDO tee "$ROOTFS/etc/apt/sources.list" >/dev/null <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
$SUDO tee "$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-slim" >/dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
$SUDO find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
$SUDO rm -rf "$ROOTFS"/usr/share/{man,info}/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -print0 \
    | $SUDO xargs -0 rm -rf
: | $SUDO tee "$ROOTFS/etc/resolv.conf" >/dev/null
echo localhost | $SUDO tee "$ROOTFS/etc/hostname" >/dev/null

# An imported image has no config at all: give it the PATH and CMD the official one has.
$SUDO tar --numeric-owner -C "$ROOTFS" -c . \
    | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' \
        --message "debootstrap --variant=minbase $SUITE $MIRROR, with $OS_PACKAGES" \
        - "$IMAGE" >/dev/null
log "$IMAGE bootstrapped and imported in $((SECONDS - start)) s"
"$DOCKER" image ls "$IMAGE"
