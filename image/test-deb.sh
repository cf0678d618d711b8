#!/usr/bin/env bash
# Installs the package into a minimal Debian 12 root (mmdebstrap, from Debian's packages) and, chrooted, checks the
# configuration, starts the appliance and answers one call of each demo model. Needs root; slow (minutes).
#
#   bash image/test-deb.sh build/opcua-inference-appliance_<version>_amd64.deb
set -euo pipefail
DEB=$(readlink -f "$1")
command -v mmdebstrap >/dev/null || apt-get install -y -qq mmdebstrap >/dev/null
ROOT=$(mktemp -d)
cleanup() {
  # stop what this test started in the root (it shares the host's network), then unmount before removing
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$ROOT" ] && kill -9 "$pid" 2>/dev/null || true
  done
  umount -l "$ROOT/proc" 2>/dev/null || true
  rm -rf "$ROOT"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
UA_PORT=$(free_port); HTTP_PORT=$(free_port)
start=$(date +%s)
mmdebstrap --quiet --variant=minbase --include=python3.11,libgomp1,adduser,systemd bookworm "$ROOT"
cp "$DEB" "$ROOT/tmp/appliance.deb"
chroot "$ROOT" dpkg -i /tmp/appliance.deb
echo "installed in $(( $(date +%s) - start )) s; root $(du -sh "$ROOT" | cut -f1)"
mount -t proc proc "$ROOT/proc"
chroot "$ROOT" appliance check-config /etc/appliance/appliance.yaml
chroot "$ROOT" test -f /var/lib/appliance/pki/own/cert.der
chroot "$ROOT" test -L /etc/systemd/system/multi-user.target.wants/appliance.service
# Self-test: the shipped configuration on free loopback ports (the root shares this machine's network), served as
# the service user; then each demo model is called as a commissioning client would.
sed -e "s|opc.tcp://0.0.0.0:4840|opc.tcp://127.0.0.1:$UA_PORT|" -e "s|0.0.0.0:9464|127.0.0.1:$HTTP_PORT|" \
  "$ROOT/etc/appliance/appliance.yaml" > "$ROOT/etc/appliance/selftest.yaml"
chmod 0644 "$ROOT/etc/appliance/selftest.yaml"
chroot "$ROOT" su -s /bin/sh appliance -c \
  "cd /var/lib/appliance && nohup /opt/appliance/venv/bin/appliance serve --config /etc/appliance/selftest.yaml \
   > /var/lib/appliance/serve.log 2>&1 &"
for _ in $(seq 1 120); do
  chroot "$ROOT" /opt/appliance/venv/bin/python -c \
    "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$HTTP_PORT/readyz').status != 200)" \
    2>/dev/null && break
  sleep 2
done
chroot "$ROOT" su -s /bin/sh appliance -c \
  "appliance call te-classifier --config /etc/appliance/selftest.yaml --input '[$(python3 -c 'print(",".join(["0.5"]*1040))')]'"
chroot "$ROOT" su -s /bin/sh appliance -c \
  "appliance call assistant --config /etc/appliance/selftest.yaml --prompt 'What is a centrifugal pump?'"
echo "test-deb: PASS ($(( $(date +%s) - start )) s in all)"
