#!/usr/bin/env bash
# One line per build step: what it was and how long it took, its full output in a log file.
#
#   scripts/step.sh "the OS base image" build/logs/base.log command args...
#
# prints "==> the OS base image ... 103 s (log: build/logs/base.log)". On failure it prints the
# last 30 lines of the log and exits with the command's code. VERBOSE=1 shows the output as it
# comes instead (the log is still written).
set -uo pipefail

what=$1 log=$2
shift 2
mkdir -p "$(dirname "$log")"
start=$SECONDS
if [ "${VERBOSE:-0}" = 1 ]; then
    "$@" 2>&1 | tee "$log"
    code=${PIPESTATUS[0]}
else
    printf '==> %s ... ' "$what"
    "$@" >"$log" 2>&1
    code=$?
fi
if [ "$code" != 0 ]; then
    printf 'FAILED after %d s (exit %d); the last lines of %s:\n' $((SECONDS - start)) "$code" "$log"
    tail -n 30 "$log" | sed 's/^/    /'
    exit "$code"
fi
[ "${VERBOSE:-0}" = 1 ] || printf '%d s (log: %s)\n' $((SECONDS - start)) "$log"
