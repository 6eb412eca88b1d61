#!/usr/bin/env bash
# compose/slurm's daemons: `slurm-entrypoint slurmctld` or `slurm-entrypoint slurmd`.
# The munge key is shared through the volume at /etc/munge-key: the controller creates it once,
# every node waits for it and installs its own copy (munged wants it owned by munge, mode 0400).
set -euo pipefail
role=${1:?usage: slurm-entrypoint slurmctld|slurmd}
shared_key=/etc/munge-key/munge.key

if [ "$role" = slurmctld ] && [ ! -s "$shared_key" ]; then
    umask 077
    dd if=/dev/urandom of="$shared_key.tmp" bs=1024 count=1 status=none
    mv "$shared_key.tmp" "$shared_key"
fi
for _ in $(seq 1 120); do
    [ -s "$shared_key" ] && break
    sleep 0.5
done
[ -s "$shared_key" ] || { echo "slurm-entrypoint: no munge key in $shared_key" >&2; exit 1; }
install -o munge -g munge -m 0400 "$shared_key" /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged

case "$role" in
    slurmctld) exec /usr/sbin/slurmctld -D -i ;;
    slurmd) exec /usr/sbin/slurmd -D ;;
    *) exec "$@" ;;
esac
