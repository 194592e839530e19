#!/usr/bin/env bash
# Install what the `qemu` runtime driver needs and build its guest artefacts.
#
# - apt: qemu-system-x86 (7.2 on bookworm), qemu-utils (qemu-img), busybox-static (the
#   initramfs' shell), e2fsprogs (mkfs.ext4 -d builds the disk images).
# - The guest kernel: Debian's `linux-image-cloud-amd64` (smaller, boots faster than the
#   generic one and has ext4 built in). Every virtio driver is a module in both flavours and
#   microvm has no PCI, so the artefacts include a tiny initramfs that loads them. The kernel
#   package is downloaded and unpacked under /opt/aenv/vm/qemu/kernel/ only: it is NOT installed
#   as a host kernel (no bootloader or initramfs hooks run on the host).
# - Guest artefacts under /opt/aenv/vm/qemu/<content hash>/ (kernel, initramfs, tools image with
#   envd and its Python bundle), /opt/aenv/vm/qemu/current -> the newest. A rebuild makes a new
#   directory, so running VMs keep theirs.
#
# Idempotent: does nothing that is already done. Needs root; reaches only Debian's archive.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VM_DIR=${AENV_VM_DIR:-/opt/aenv/vm/qemu}
KERNEL_META=${AENV_VM_KERNEL:-linux-image-cloud-amd64}
log() { echo "install-vm: $*" >&2; }

missing=()
for p in qemu-system-x86 qemu-utils busybox-static e2fsprogs; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing apt packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The versioned kernel package the meta package points at, e.g. linux-image-6.1.0-57-cloud-amd64.
pkg=$(apt-cache depends "$KERNEL_META" 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [[ -z "$pkg" ]]; then
  apt-get update -qq
  pkg=$(apt-cache depends "$KERNEL_META" | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
[[ -n "$pkg" ]] || { log "cannot resolve $KERNEL_META"; exit 1; }
kdir="$VM_DIR/kernel/$pkg"
if [[ ! -f "$kdir/.complete" ]]; then
  log "fetching guest kernel $pkg"
  tmp=$(mktemp -d)
  chmod 755 "$tmp"  # apt's sandbox user writes the .deb here
  (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1)
  rm -rf "$kdir.tmp" && mkdir -p "$kdir.tmp"
  dpkg-deb -x "$tmp"/"$pkg"_*.deb "$kdir.tmp"
  rm -rf "$tmp" "$kdir"
  mv "$kdir.tmp" "$kdir"
  touch "$kdir/.complete"
fi

"$PY" -m aenv.runtime.qemu.artefacts build --kernel-dir "$kdir" --dest "$VM_DIR"
