#!/usr/bin/env bash
# The quick install test (CI runs it, .ci/run): installs the package into a minimal Debian 12 root (mmdebstrap) with
# no systemd running, as an image build does, and checks, chrooted: the service user and the directory modes come
# from the package's sysusers/tmpfiles entries, check-config, the PKI made by postinst, the unit enabled; serves the
# shipped configuration as the service user and answers one call of each demo model; then `dpkg --purge` leaves
# nothing behind. Needs root; about two minutes. (Under systemd as PID 1: scripts/acceptance.sh.)
#
#   bash image/test-deb.sh build/opcua-inference-appliance_<version>_amd64.deb
set -euo pipefail
DEB=$(readlink -f "$1")
command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; }
ROOT=$(mktemp -d)
cleanup() {
  # stop what this test started in the root (it shares the host's network), then unmount before removing
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$ROOT" ] && kill -9 "$pid" 2>/dev/null || true
  done
  umount -l "$ROOT/proc" 2>/dev/null || true
  rm -rf "$ROOT" "$ROOT.before" "$ROOT.after"
}
trap cleanup EXIT
fail() { echo "test-deb: FAIL: $*" >&2; exit 1; }
# Two distinct free ports, both sockets bound until both are chosen (the kernel may give one port to two binds in a row).
free_ports() { python3 -c 'import socket; s=[socket.socket() for _ in range(2)]; [x.bind(("127.0.0.1", 0)) for x in s]; print(*[x.getsockname()[1] for x in s])'; }
# Every path of the root, less what dpkg and the shadow tools change for any package (their logs and backups)
files() {
  (cd "$ROOT" && find . -xdev | sed 's|^\.||' | grep -Ev \
    '^/(proc|root|tmp|var/lib/dpkg|var/cache/debconf|var/cache/ldconfig)(/|$)|^/var/log/(dpkg\.log|apt|alternatives\.log)|^/etc/(passwd|group|shadow|gshadow)-$|^/etc/ld\.so\.cache$' \
    | sort)
}
read -r UA_PORT HTTP_PORT < <(free_ports)
start=$(date +%s)
mmdebstrap --quiet --variant=minbase --include=python3.11,libgomp1,systemd,passwd,util-linux,procps bookworm "$ROOT"
files > "$ROOT.before"
# a root being installed has /proc (mmdebstrap mounts it for its hooks; systemd-tmpfiles needs it)
mount -t proc proc "$ROOT/proc"
cp "$DEB" "$ROOT/tmp/appliance.deb"
chroot "$ROOT" dpkg -i /tmp/appliance.deb
echo "installed in $(( $(date +%s) - start )) s; root $(du -shx "$ROOT" | cut -f1)"

# The user from the package's sysusers entry, the directories with the modes of its tmpfiles entries (which the
# unit's *DirectoryMode= settings agree with), the PKI, the unit enabled for the next boot
uid=$(chroot "$ROOT" getent passwd appliance | cut -d: -f3)
[ -n "$uid" ] && [ "$uid" -gt 0 ] && [ "$uid" -lt 1000 ] || fail "no system user appliance ($uid)"
modes=$(chroot "$ROOT" stat -c '%n %a %U %G' /etc/appliance /etc/appliance/appliance.yaml /var/lib/appliance \
  /var/lib/appliance/pki | tr '\n' ';')
[ "$modes" = "/etc/appliance 750 root appliance;/etc/appliance/appliance.yaml 640 root appliance;/var/lib/appliance 750 appliance appliance;/var/lib/appliance/pki 750 appliance appliance;" ] \
  || fail "modes: $modes"
chroot "$ROOT" appliance check-config /etc/appliance/appliance.yaml
chroot "$ROOT" test -f /var/lib/appliance/pki/own/cert.der || fail "postinst made no PKI"
[ "$(stat -c %u "$ROOT/var/lib/appliance/pki/own/cert.der")" = "$uid" ] || fail "the PKI is not the service user's"
chroot "$ROOT" test -L /etc/systemd/system/multi-user.target.wants/appliance.service || fail "unit not enabled"

# Self-test: the shipped configuration on free loopback ports (the root shares this machine's network), served as
# the service user; then each demo model is called as a commissioning client would.
# The engine settings as shipped (the root has no compiler, as a box: the decode step stays eager, said at once).
chroot "$ROOT" /opt/appliance/venv/bin/python -c "import sys, yaml
d = yaml.safe_load(open('/etc/appliance/appliance.yaml'))
d['server']['endpoint'] = 'opc.tcp://127.0.0.1:$UA_PORT'
d['metrics']['listen'] = '127.0.0.1:$HTTP_PORT'
yaml.safe_dump(d, open('/etc/appliance/selftest.yaml', 'w'))"
chroot "$ROOT" chgrp appliance /etc/appliance/selftest.yaml
chroot "$ROOT" setpriv --reuid appliance --regid appliance --init-groups sh -c \
  "cd /var/lib/appliance && nohup /opt/appliance/venv/bin/appliance serve --config /etc/appliance/selftest.yaml \
   > /var/lib/appliance/serve.log 2>&1 &"
ready=0
for _ in $(seq 1 150); do
  if chroot "$ROOT" /opt/appliance/venv/bin/python -c \
    "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$HTTP_PORT/readyz').status != 200)" \
    2>/dev/null; then ready=1; break; fi
  sleep 2
done
[ $ready = 1 ] || { cat "$ROOT/var/lib/appliance/serve.log" >&2; fail "not ready within 300 s"; }
as_user() { chroot "$ROOT" setpriv --reuid appliance --regid appliance --init-groups "$@"; }
serve_log() { tail -40 "$ROOT/var/lib/appliance/serve.log" >&2; }
as_user appliance call te-classifier --config /etc/appliance/selftest.yaml \
  --input "[$(python3 -c 'print(",".join(["0.5"]*1040))')]" || { serve_log; fail "Infer"; }
as_user appliance call assistant --config /etc/appliance/selftest.yaml --prompt 'What is a centrifugal pump?' \
  || { serve_log; fail "Generate"; }
for pid in $(ls /proc | grep -E '^[0-9]+$'); do
  [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$ROOT" ] && kill "$pid" 2>/dev/null || true
done
sleep 2

# Purge: nothing of the package, its user, its state or its configuration is left
chroot "$ROOT" dpkg --purge opcua-inference-appliance
umount "$ROOT/proc"
files > "$ROOT.after"
diff "$ROOT.before" "$ROOT.after" >&2 || fail "the purge left the root different from before the install"
! grep -q appliance "$ROOT/etc/passwd" "$ROOT/etc/group" "$ROOT/etc/shadow" "$ROOT/etc/gshadow" \
  || fail "the purge left the service user"
echo "test-deb: PASS ($(( $(date +%s) - start )) s in all)"
