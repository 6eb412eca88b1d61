#!/usr/bin/env bash
# Install the OS packages listed in LIST (images/os-packages.txt) that the image lacks; apt-get
# runs only when one is missing. The Dockerfile runs it in the builder and in the runtime stage.
# Usage: install-os-packages.sh LIST
set -euo pipefail

list=${1:?usage: install-os-packages.sh LIST}
# One package a line; comments, blanks and blank lines dropped (make-base.sh reads it the same way).
mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$list")
if [ ${#packages[@]} -eq 0 ]; then
    echo "install-os-packages: no packages in $list" >&2
    exit 1
fi

if dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    echo "install-os-packages: all there: ${packages[*]}"
    exit 0
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${packages[@]}"
rm -rf /var/lib/apt/lists/*
