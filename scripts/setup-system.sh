#!/usr/bin/env bash
# Debian packages the tests use as real peers: Prometheus (promtool, a live scrape) and headless Chromium (the status
# page), plus systemd-analyze (the unit's checks). Installs only what is missing; needs root and apt (CI runs as root).
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-system: missing ${need[*]} (Debian packages); install them as root, or their tests are skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
