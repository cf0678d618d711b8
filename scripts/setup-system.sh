#!/usr/bin/env bash
# Debian packages the tests use as real peers: Prometheus (promtool, a live scrape) and headless Chromium (the status
# page), plus systemd-analyze (the unit's checks), iproute2 (a PLC's link cut in a network namespace) and kubectl
# (its built-in kustomize renders the fleet manifests).
# Installs only what is missing; needs root and apt (CI runs as root).
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v ip >/dev/null || need+=(iproute2)  # tests/test_ua_dead_peer.py: a PLC in a network namespace
# kubectl is not one of Debian's own packages: machines of this kind carry it (and the apt source it comes from);
# elsewhere tests/test_k8s.py says it is skipped for want of it.
optional=()
command -v kubectl >/dev/null || optional+=(kubectl)
[ ${#need[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "setup-system: missing ${need[*]} ${optional[*]} (Debian packages); install them as root, or their tests are skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
[ ${#need[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
[ ${#optional[@]} -eq 0 ] || apt-get install -y -qq --no-install-recommends "${optional[@]}" >/dev/null \
  || echo "setup-system: ${optional[*]} could not be installed; tests/test_k8s.py is skipped" >&2
