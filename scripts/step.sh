#!/usr/bin/env bash
# One line per build step: what it was and how long it took, its full output in a log file.
#
#   scripts/step.sh "the OS base image" build/logs/base.log command args...
#
# prints "==> the OS base image ... 103 s (log: build/logs/base.log)". On failure it prints the
# last 30 lines of the log and exits with the command's code. VERBOSE=1 shows the output as it
# comes instead (the log is still written).
#
# Each step also adds a line to steps.tsv beside its log (what `make bench` reads build times from):
# end time, STEP_RUN (one value per make run, from the Makefile), seconds, exit code, what, log,
# and for a docker build how many of its steps came from the cache, of how many.
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
# docker build's steps: "Step 3/20 : ..." (classic builder) or "#7 [stage 2/5] ..." (BuildKit);
# from the cache: " ---> Using cache" or "#7 CACHED".
steps=$(grep -c -E '^Step [0-9]+/[0-9]+ : |^#[0-9]+ \[[^]]* [0-9]+/[0-9]+\] ' "$log" || true)
cached=$(grep -c -E '^ ---> Using cache$|^#[0-9]+ CACHED$' "$log" || true)
printf '%s\t%s\t%d\t%d\t%s\t%s\t%d\t%d\n' "$(date +%s)" "${STEP_RUN:-}" $((SECONDS - start)) "$code" "$what" "$log" \
    "$cached" "$steps" >> "$(dirname "$log")/steps.tsv"
if [ "$code" != 0 ]; then
    printf 'FAILED after %d s (exit %d); the last lines of %s:\n' $((SECONDS - start)) "$code" "$log"
    tail -n 30 "$log" | sed 's/^/    /'
    exit "$code"
fi
[ "${VERBOSE:-0}" = 1 ] || printf '%d s (log: %s)\n' $((SECONDS - start)) "$log"
