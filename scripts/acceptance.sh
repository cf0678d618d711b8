#!/usr/bin/env bash
# The acceptance test of the installed product (tests/acceptance_installed.py): the Debian package installed into a
# minimal Debian 12 booted with systemd as PID 1 (systemd-nspawn -b), checked as a plant would. Needs root; takes
# several minutes; its own command, not part of scripts/test.sh.
#
#   bash scripts/acceptance.sh [DEB]      (no DEB: builds it first with image/build-deb.sh into build/)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "acceptance: needs root (mmdebstrap, systemd-nspawn)" >&2; exit 2; }
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v prometheus >/dev/null || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || bash scripts/setup.sh --test
start=$(date +%s)
if [ $# -ge 1 ]; then
  DEB=$(readlink -f "$1")
else
  DEB=$(readlink -f "$(bash image/build-deb.sh build | tail -1 | cut -d' ' -f1)")
  echo "acceptance: package built in $(( $(date +%s) - start )) s"
fi
APPLIANCE_DEB=$DEB .venv/bin/python -m pytest -v -s -p no:cacheprovider --timeout=3600 tests/acceptance_installed.py
echo "acceptance: $(( $(date +%s) - start )) s in all"
