#!/usr/bin/env bash
# compose/ssh's hosts: new host keys, the user trainpod's authorized key from SSH_AUTHORIZED_KEY, sshd.
set -euo pipefail
: "${SSH_AUTHORIZED_KEY:?set SSH_AUTHORIZED_KEY to the public key that may log in as trainpod}"
ssh-keygen -A >/dev/null
install -d -o trainpod -g trainpod -m 0700 /home/trainpod/.ssh
printf '%s\n' "$SSH_AUTHORIZED_KEY" > /home/trainpod/.ssh/authorized_keys
chown trainpod:trainpod /home/trainpod/.ssh/authorized_keys
chmod 0600 /home/trainpod/.ssh/authorized_keys
exec /usr/sbin/sshd -D -e
