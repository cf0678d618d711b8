#!/usr/bin/env bash
# Installs the package into a minimal Debian 12 root (mmdebstrap, from Debian's packages) and, chrooted, checks the
# configuration, starts the appliance and answers one call of each demo model. Needs root; slow (minutes).
#
#   bash image/test-deb.sh build/opcua-inference-appliance_<version>_amd64.deb
set -euo pipefail
DEB=$(readlink -f "$1")
command -v mmdebstrap >/dev/null || apt-get install -y -qq mmdebstrap >/dev/null
ROOT=$(mktemp -d)
cleanup() { umount -R "$ROOT/proc" 2>/dev/null || true; rm -rf "$ROOT"; }
trap cleanup EXIT
start=$(date +%s)
mmdebstrap --quiet --variant=minbase --include=python3.11,libgomp1,adduser,systemd bookworm "$ROOT"
cp "$DEB" "$ROOT/tmp/appliance.deb"
chroot "$ROOT" dpkg -i /tmp/appliance.deb
echo "installed in $(( $(date +%s) - start )) s; root $(du -sh "$ROOT" | cut -f1)"
mount -t proc proc "$ROOT/proc"
chroot "$ROOT" appliance check-config /etc/appliance/appliance.yaml
chroot "$ROOT" test -f /var/lib/appliance/pki/own/cert.der
chroot "$ROOT" test -L /etc/systemd/system/multi-user.target.wants/appliance.service
# Self-test: serve on loopback as the service user, then call each demo model as a commissioning client would.
chroot "$ROOT" su -s /bin/sh appliance -c \
  "cd /var/lib/appliance && nohup /opt/appliance/venv/bin/appliance serve --config /etc/appliance/appliance.yaml \
   > /var/lib/appliance/serve.log 2>&1 &"
for _ in $(seq 1 120); do
  chroot "$ROOT" /opt/appliance/venv/bin/python -c \
    "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9464/readyz').status != 200)" \
    2>/dev/null && break
  sleep 2
done
chroot "$ROOT" su -s /bin/sh appliance -c \
  "appliance call te-classifier --config /etc/appliance/appliance.yaml --input '[$(python3 -c 'print(",".join(["0.5"]*1040))')]'"
chroot "$ROOT" su -s /bin/sh appliance -c \
  "appliance call assistant --config /etc/appliance/appliance.yaml --prompt 'What is a centrifugal pump?'"
chroot "$ROOT" pkill -f "appliance serve" || true
echo "test-deb: PASS"
