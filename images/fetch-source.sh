#!/usr/bin/env bash
# Put the source of a project the image build compiles (cuda-apex: NVIDIA Apex) into DEST, from
# SOURCE, which is one of
#   - a git URL (https://..., ssh://..., git@host:..., file://..., or ending in .git), at REF (a
#     commit, tag or branch; fetched once into build/cache/git/ and reused);
#   - a tarball (.tar.gz, .tgz, .tar.xz, .tar) holding the source, alone in its top folder or not;
#   - a directory holding the source.
# The source must have MARKER (setup.py) at its top. STAMP holds a hash of the source and is
# rewritten only when the source changed, so that make rebuilds the image only then. When SOURCE
# cannot be had, one line says what to pass instead (VARIABLE=...) and the exit code is 1, before
# anything long has started.
#
# Usage: fetch-source.sh NAME VARIABLE SOURCE REF DEST STAMP [EXAMPLE]
#   e.g. fetch-source.sh Apex APEX_SOURCE https://github.com/NVIDIA/apex.git 6424da3b... build/ext/cuda-apex/src/apex \
#            build/ext/cuda-apex/source.sha ../shared/vendor/apex-6424da3b4faa.tar.gz
# Settings (environment): GIT_CACHE (build/cache/git), FETCH_TIMEOUT_S (300), MARKER (setup.py).
set -euo pipefail
commit=

usage="usage: fetch-source.sh NAME VARIABLE SOURCE REF DEST STAMP [EXAMPLE]"
name=${1:?$usage} variable=${2:?$usage} source=${3-} ref=${4-} dest=${5:?$usage} stamp=${6:?$usage} example=${7-}
GIT_CACHE=${GIT_CACHE:-build/cache/git}
FETCH_TIMEOUT_S=${FETCH_TIMEOUT_S:-300}
MARKER=${MARKER:-setup.py}

fail() {
    local hint="pass $variable=URL ${variable%_SOURCE}_REF=COMMIT (git), $variable=FILE.tar.gz or $variable=DIR (with $name's $MARKER)"
    [ -z "$example" ] || hint+=", e.g. $variable=$example"
    echo "make: no $name source: $*; $hint" >&2
    exit 1
}

scratch=$(mktemp -d "${TMPDIR:-/tmp}/fetch-source.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
tree=$scratch/tree
mkdir -p "$tree"

is_git_url() { [[ $1 =~ ^(https?|ssh|git|file):// || $1 =~ ^[^/]+@[^/]+: || $1 == *.git ]] && [ ! -e "$1" ]; }

if [ -z "$source" ]; then
    fail "$variable is empty"
elif [ -d "$source" ]; then
    tar -C "$source" --exclude=.git --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$tree" -xf -
elif [ -f "$source" ]; then
    case $source in
        *.tar.gz | *.tgz | *.tar.xz | *.txz | *.tar.bz2 | *.tar) tar -C "$tree" -xf "$source" || fail "cannot unpack $source" ;;
        *) fail "$source is neither a directory nor a tarball" ;;
    esac
elif is_git_url "$source"; then
    [ -n "$ref" ] || fail "$source is a git URL and ${variable%_SOURCE}_REF is empty"
    command -v git >/dev/null || fail "$source is a git URL and git is not installed"
    repo=$GIT_CACHE/$(printf '%s' "$source" | sha256sum | cut -c1-16)
    mkdir -p "$repo"
    git -C "$repo" init -q 2>/dev/null
    if ! git -C "$repo" cat-file -e "$ref^{commit}" 2>/dev/null; then
        if ! error=$(GIT_TERMINAL_PROMPT=0 timeout "$FETCH_TIMEOUT_S" git -C "$repo" fetch -q --depth 1 "$source" "$ref" 2>&1); then
            fail "cannot fetch $source at $ref ($(printf '%s' "$error" | grep -v '^$' | tail -n 1))"
        fi
        git -C "$repo" tag -f "fetched-$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' _)" FETCH_HEAD >/dev/null
    fi
    commit=$(git -C "$repo" rev-parse "$ref^{commit}" 2>/dev/null \
        || git -C "$repo" rev-parse "fetched-$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' _)^{commit}")
    git -C "$repo" archive "$commit" | tar -C "$tree" -xf -
else
    fail "$source does not exist (and is no git URL)"
fi

# A tarball or archive with one top folder (apex/): its content is the source.
top=$(find "$tree" -mindepth 1 -maxdepth 1)
if [ ! -f "$tree/$MARKER" ] && [ "$(printf '%s\n' "$top" | wc -l)" = 1 ] && [ -d "$top" ]; then
    tree=$top
fi
[ -f "$tree/$MARKER" ] || fail "$source holds no $MARKER at its top"

sha=$(tar -C "$tree" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | sha256sum | cut -d' ' -f1)
if [ -d "$dest" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sha" ]; then
    exit 0  # unchanged: the stamp keeps its time, and nothing is rebuilt
fi
rm -rf "$dest"
mkdir -p "$(dirname "$dest")" "$(dirname "$stamp")"
cp -a "$tree" "$dest"
echo "$sha" > "$stamp"
echo "fetch-source: $name from $source${commit:+ at $commit} ($(du -sh "$dest" | cut -f1), sha256 of the tree ${sha:0:12})"
