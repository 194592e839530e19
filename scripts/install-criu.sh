#!/usr/bin/env bash
# Install CRIU 4.2.1 to /usr/local/sbin/criu on Debian 12 (bookworm).
#
# Why not `apt-get install criu`: bookworm ships CRIU 3.17, which does not
# start on kernels with the `vvar_vclock` vDSO layout (fixed in 4.1).
# Why not 4.1.1 (trixie): on kernels >= 6.16 getsockopt(SO_PASSCRED/SO_PASSSEC)
# fails with EOPNOTSUPP on TCP sockets, so 4.1.1 cannot dump any process
# holding a TCP socket (envd listens on :49983). Fixed in 4.2 (criu PR #2719).
# We build upstream 4.2.1 from the orig tarball that Debian sid/forky ships,
# verified against the sha256 in Debian's signed Sources index.
#
# Idempotent: exits 0 at once when `criu --version` already says 4.2.1.
# Needs root. Network: only Debian's package archive (through apt).
#
# Env overrides:
#   CRIU_PREFIX   install prefix (default /usr/local -> /usr/local/sbin/criu)
#   CRIU_TARBALL  path of an already downloaded criu_4.2.1.orig.tar.xz
#   CRIU_FORCE=1  rebuild even if 4.2.1 is installed
#   CRIU_NO_CACHE=1  ignore local tarball copies, always download
#   CRIU_KEEP_BUILD=1  keep the build directory
set -euo pipefail

VERSION=4.2.1
TARBALL=criu_${VERSION}.orig.tar.xz
SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
PREFIX=${CRIU_PREFIX:-/usr/local}
DEST="$PREFIX/sbin/criu"
MIRROR=http://deb.debian.org/debian

log() { echo "install-criu: $*" >&2; }

# Our patches on top of upstream; the build id changes whenever they do, so a host with an
# older build of ours rebuilds.
HERE=$(cd "$(dirname "$0")" && pwd)
PATCHES=("$HERE/criu-rlimits-from-proc.patch" "$HERE/criu-empty-tmpfs.patch" "$HERE/criu-aenv-fast.patch")
# CRIU caches its probe of the kernel's features (~tens of ms per run) only on a tmpfs;
# /run is not one on every host, /dev/shm is. No GnuTLS (TLS page server) and no nftables
# (aenv runs criu with --network-lock skip): whichever -dev packages the host happens to
# have, criu then loads 9 shared libraries instead of 23, 3.5 ms less per criu run (one per
# pause, resume, snapshot and fork child). Make has no switch for nftables: criu's build
# gets a pkg-config that does not see it.
MAKE_VARS=(RUNDIR=/dev/shm NO_GNUTLS=1)
NO_NFTABLES_PKG_CONFIG='#!/bin/sh
for a in "$@"; do case "$a" in libnftables*) exit 1;; esac; done
exec pkg-config "$@"'
BUILD_ID="$VERSION+$( (cat "${PATCHES[@]}"; echo "${MAKE_VARS[*]}"; echo "$NO_NFTABLES_PKG_CONFIG") | sha256sum | cut -c1-12)"
BUILD_ID_FILE="$PREFIX/share/aenv/criu-build-id"

if [[ -z "${CRIU_FORCE:-}" && -x "$DEST" && "$(cat "$BUILD_ID_FILE" 2>/dev/null)" == "$BUILD_ID" ]]; then
    log "$DEST is already CRIU $BUILD_ID"
    exit 0
fi
[[ $(id -u) -eq 0 ]] || { log "must run as root"; exit 1; }

# Minimal build deps (criu/Makefile.packages links -lprotobuf-c -lnl-3 -lnet
# -luuid; compel needs libcap; protoc (protobuf-compiler, with the protoc-c
# plugin from protobuf-c-compiler) generates the image code;
# libprotobuf-dev only for /usr/include/google/protobuf/descriptor.proto,
# which images/google/protobuf/descriptor.proto is a symlink to).
# libbsd-dev: setproctitle() so restored helpers have readable names.
# Not needed: python3-protobuf (only for
# crit/tests), libaio-dev (tests), asciidoc/xmlto (docs), gnutls (TLS page
# server), libnftables-dev (--network-lock nftables), libdrm (amdgpu plugin).
BUILD_DEPS=(build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler protobuf-compiler libprotobuf-dev
            libnl-3-dev libnet1-dev libcap-dev uuid-dev libbsd-dev
            xz-utils ca-certificates curl patch)
missing=()
for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

WORK=$(mktemp -d /tmp/install-criu.XXXXXX)
cleanup() { [[ -n "${CRIU_KEEP_BUILD:-}" ]] || rm -rf "$WORK"; }
trap cleanup EXIT

check_sha() { echo "$SHA256  $1" | sha256sum -c --quiet - >/dev/null 2>&1; }

fetch_tarball() {
    local out="$WORK/$TARBALL"
    # 1. a local copy
    local cands=("${CRIU_TARBALL:-}" "/tmp/criu/$TARBALL" "/var/cache/aenv/$TARBALL")
    [[ -z "${CRIU_NO_CACHE:-}" ]] || cands=()
    for c in "${cands[@]}"; do
        if [[ -n "$c" && -f "$c" ]] && check_sha "$c"; then cp "$c" "$out"; echo "$out"; return; fi
    done
    # 2. apt-get source from sid/forky (4.2.1 is not in trixie), with a private apt state dir so the
    #    system's sources.list is left alone.
    local A="$WORK/apt"
    mkdir -p "$A/sources.list.d" "$A/lists/partial"
    cat >"$A/sources.list.d/trixie-src.sources" <<EOF
Types: deb-src
URIs: $MIRROR
Suites: sid forky
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    local O=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$A/sources.list.d"
             -o "Dir::State::Lists=$A/lists" -o "APT::Sandbox::User=root")
    if apt-get "${O[@]}" update -qq >/dev/null 2>&1; then
        (cd "$WORK" && apt-get "${O[@]}" source --download-only "criu=${VERSION}-1" >/dev/null 2>&1) || true
    fi
    if [[ -f "$out" ]] && check_sha "$out"; then echo "$out"; return; fi
    # 3. straight from the archive pool (still there while any suite lists it)
    rm -f "$out"
    curl -fsSL -o "$out" "$MIRROR/pool/main/c/criu/$TARBALL" || true
    if [[ -f "$out" ]] && check_sha "$out"; then echo "$out"; return; fi
    log "could not get $TARBALL with sha256 $SHA256"
    return 1
}

tb=$(fetch_tarball)
log "building from $tb"
tar -C "$WORK" -xf "$tb"
src="$WORK/criu-$VERSION"
for p in "${PATCHES[@]}"; do
    patch -d "$src" -p1 --forward --quiet < "$p"
done
# `make criu` builds compel, soccr and the criu binary only (no docs, no
# python libs, no plugins).
echo "$NO_NFTABLES_PKG_CONFIG" > "$WORK/pkg-config" && chmod +x "$WORK/pkg-config"
make -C "$src" -j"$(nproc)" "${MAKE_VARS[@]}" PKG_CONFIG="$WORK/pkg-config" criu >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; exit 1; }
install -D -m 0755 "$src/criu/criu" "$DEST"
install -D -m 0644 /dev/null "$BUILD_ID_FILE" && echo "$BUILD_ID" > "$BUILD_ID_FILE"
log "installed $("$DEST" --version | tr '\n' ' ')"
# Report what the kernel supports (non-fatal: missing soft-dirty is expected
# on some hosts, which only disables incremental pre-dump).
"$DEST" check 2>&1 | sed 's/^/install-criu: criu check: /' >&2 || true
