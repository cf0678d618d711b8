#!/usr/bin/env bash
# A root file system with the appliance installed and its unit enabled (mmdebstrap + the package), as a tarball for
# an industrial PC's installer, and an OCI image of the same root (umoci) for container platforms at the edge.
# Needs root; slow (minutes).
#
#   bash image/build-image.sh build/opcua-inference-appliance_<version>_amd64.deb [OUT_DIR]
set -euo pipefail
DEB=$(readlink -f "$1")
OUT=$(readlink -f "${2:-build}")
mkdir -p "$OUT"
for tool in mmdebstrap umoci; do command -v $tool >/dev/null || apt-get install -y -qq $tool >/dev/null; done
VERSION=$(dpkg-deb -f "$DEB" Version)
ROOTFS="$OUT/appliance-rootfs-$VERSION.tar"
start=$(date +%s)
mmdebstrap --quiet --variant=minbase --include=python3.11,libgomp1,passwd,systemd,systemd-sysv,iproute2 \
  --customize-hook="copy-in $DEB /tmp" \
  --customize-hook='chroot "$1" sh -c "APPLIANCE_IMAGE_BUILD=1 dpkg -i /tmp/*.deb && rm /tmp/*.deb"' \
  bookworm "$ROOTFS"
echo "rootfs: $ROOTFS ($(du -h "$ROOTFS" | cut -f1)) in $(( $(date +%s) - start )) s"

# OCI: the same root as one layer; the entry point is the appliance itself (no systemd inside a container).
start=$(date +%s)
OCI="$OUT/appliance-oci"
rm -rf "$OCI"
umoci init --layout "$OCI"
umoci new --image "$OCI:$VERSION"
BUNDLE=$(mktemp -d)
umoci unpack --rootless --image "$OCI:$VERSION" "$BUNDLE/b"
tar -xf "$ROOTFS" -C "$BUNDLE/b/rootfs"
umoci repack --image "$OCI:$VERSION" "$BUNDLE/b"
# The image runs as the service user that the package's sysusers entry made in this root (whatever uid it got), by
# number: Kubernetes' runAsNonRoot can only check a numeric user.
OWNER=$(tar -xOf "$ROOTFS" ./etc/passwd | awk -F: '$1 == "appliance" {print $3 ":" $4}')
[ -n "$OWNER" ] || { echo "build-image: the root has no appliance user (did the package install?)" >&2; exit 1; }
umoci config --image "$OCI:$VERSION" --config.user "$OWNER" --config.workingdir /var/lib/appliance \
  --config.entrypoint /opt/appliance/venv/bin/appliance --config.cmd serve --config.cmd --config \
  --config.cmd /etc/appliance/appliance.yaml --config.exposedports 4840/tcp --config.exposedports 9464/tcp
rm -rf "$BUNDLE"
tar -C "$OCI" -cf "$OUT/appliance-oci-$VERSION.tar" .
echo "OCI image: $OUT/appliance-oci-$VERSION.tar ($(du -h "$OUT/appliance-oci-$VERSION.tar" | cut -f1)) in $(( $(date +%s) - start )) s"
