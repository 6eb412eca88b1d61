#!/usr/bin/env bash
# The certificates of compose/elastic's TLS profile (tls.yaml), made once into $PKI_DIR (the etcd-pki
# volume): a CA; one certificate for etcd's members (server and client use: clients, the peers, and
# each member's own gateway and healthcheck), valid for etcd0-2, their addresses and localhost; one
# client certificate for the trainers. EC P-256, 30 days. Run as root by the etcd-certs service (the
# etcd image has openssl), which hands each key to its user only: etcd's (uid 2379) and the trainers'
# (uid 1000, the trainpod images' user). A volume that already holds a CA is left as it is.
set -euo pipefail

dir=${PKI_DIR:-/pki}
prefix=${TRAINPOD_SUBNET_PREFIX:-10.151.60}
etcd_uid=${ETCD_UID:-2379}
trainer_uid=${TRAINER_UID:-1000}
days=${CERT_DAYS:-30}

if [ -s "$dir/ca.pem" ]; then
    echo "make-certs: $dir already holds a CA: kept (docker compose down -v makes new ones)"
    exit 0
fi
mkdir -p "$dir"
cd "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -subj "/CN=trainpod-elastic etcd CA" -days "$days" -out ca.pem

issue() {  # name, subject, extensions
    key "$1-key.pem"
    openssl req -new -key "$1-key.pem" -subj "$2" -out "$1.csr"
    printf '%b' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days "$days" -extfile "$1.ext" \
        -out "$1.pem" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
issue etcd "/CN=etcd" "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:etcd0,DNS:etcd1,DNS:etcd2,DNS:localhost,IP:127.0.0.1,IP:$prefix.10,IP:$prefix.11,IP:$prefix.12\n"
issue trainer "/CN=trainer" "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"

rm -f ca-key.pem ca.srl  # nothing more is signed: the CA's key is not kept where every container mounts it
chmod 0444 ca.pem etcd.pem trainer.pem
chmod 0400 etcd-key.pem trainer-key.pem
if [ "$(id -u)" = 0 ]; then
    chown "$etcd_uid:$etcd_uid" etcd-key.pem
    chown "$trainer_uid:$trainer_uid" trainer-key.pem
fi
chmod 0755 "$dir"
echo "make-certs: CA, etcd's and the trainers' certificates in $dir"
