#!/usr/bin/env bash
# Install aenv on a Debian 12 or Ubuntu 24.04 host, from this checkout (docs/deploy.md).
#
#   sudo scripts/install.sh [--with-vm] [--enable aenv[,aenv-gateway,aenv-scheduler]]
#   sudo scripts/install.sh --uninstall     # removes what it added; keeps config and state
#   sudo scripts/install.sh --purge         # also removes /etc/aenv, /var/lib/aenv, the user
#
# What it installs (each step does nothing when already done; a second run changes nothing
# and says "unchanged" for every file):
#   - apt packages: the Makefile's APT_PACKAGES less the test-only ones (APT_TEST_ONLY below)
#     and etcd (APT_ETCD: --with-etcd), plus python3.11 and its venv module;
#   - aenv in a virtualenv $PREFIX/lib/aenv/venv-<source hash> (`current` points at it, the
#     one it replaced stays as `previous`), the command $PREFIX/bin/aenv, and the readiness
#     check $PREFIX/lib/aenv/aenv-health;
#   - CRIU 4.2.1 with our patches (scripts/install-criu.sh) at /usr/local/sbin/criu;
#   - the envd runtime bundle /opt/aenv/runtime/py311 (python -m aenv.runtime.pybundle build);
#   - with --with-vm: QEMU, the guest kernel and the VM artefacts (scripts/install-vm.sh);
#   - /etc/aenv/config.toml (every key, defaults commented out) and /etc/aenv/aenv.env (the
#     units' environment: API key, etcd URL, listen addresses). An existing file the operator
#     changed is kept; the new version is written beside it as <file>.dist;
#   - the `aenv` system user (gateway and scheduler run as it; the node runs as root);
#   - /var/lib/aenv (0700, root), the node's state;
#   - systemd units aenv.service (node: `aenv serve`), aenv-gateway.service and
#     aenv-scheduler.service in /etc/systemd/system, then `systemctl daemon-reload`.
#
# Options:
#   --prefix DIR     where aenv is installed (default /usr/local). Used as given, also with
#                    --root: a virtualenv only works at the path it was made at.
#   --root DIR       install /etc, /var/lib, /etc/systemd/system, /opt/aenv, /usr/local/sbin/criu
#                    under DIR instead of / (an image being built, tests). The files name their
#                    final paths (/etc/aenv/...), as with DESTDIR. No systemctl under a root.
#   --python PATH    Python 3.11 (default /usr/bin/python3.11, else python3.11 on PATH)
#   --with-vm        also the qemu runtime (QEMU + guest artefacts; uses apt itself)
#   --with-etcd      also etcd (Debian's etcd-server starts a local etcd at install) and etcdctl
#   --with-test-packages   also the test-only apt packages
#   --enable LIST    comma-separated units to enable and start (aenv,aenv-gateway,aenv-scheduler)
#   --no-apt --no-criu --no-bundle --no-user --no-systemctl   skip that step
#   --print-apt-packages   print the apt packages it would install, and exit
#   --uninstall      remove the venvs, the command, the units (and CRIU if it installed it);
#                    keep /etc/aenv, /var/lib/aenv, /opt/aenv (paused sandboxes need the bundle)
#   --purge          --uninstall, then remove /etc/aenv, /var/lib/aenv{,-gateway,-scheduler},
#                    /opt/aenv and the aenv user. Refuses while something is mounted below the
#                    state directory (the managed volume: stop the node, `umount` it first).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=/usr/local
ROOT=/
PYTHON=
ACTION=install
DO_APT=1 DO_CRIU=1 DO_BUNDLE=1 DO_USER=1 DO_SYSTEMCTL=1 DO_VM=0 TEST_PKGS=0 ETCD_PKGS=0
ENABLE=
# Used by the test suites and benchmarks only: a registry daemon (Debian enables
# docker-registry.service on :5000 at install), and image/auth tools for the test registry.
APT_TEST_ONLY=(docker-registry skopeo apache2-utils)
# The cluster's coordination service (`aenv cluster up` and the tests run one): only on the
# hosts chosen for it, since Debian starts etcd-server as a service when it is installed.
APT_ETCD=(etcd-server etcd-client)
# What the installer itself needs beyond the Makefile's list.
APT_OWN=(python3.11 python3.11-venv ca-certificates)
UNITS=(aenv aenv-gateway aenv-scheduler)

log() { echo "install.sh: $*"; }
die() { echo "install.sh: error: $*" >&2; exit 1; }

while (($#)); do
    case "$1" in
        --prefix) PREFIX=${2:?--prefix needs a directory}; shift ;;
        --prefix=*) PREFIX=${1#*=} ;;
        --root) ROOT=${2:?--root needs a directory}; shift ;;
        --root=*) ROOT=${1#*=} ;;
        --python) PYTHON=${2:?--python needs a path}; shift ;;
        --python=*) PYTHON=${1#*=} ;;
        --enable) ENABLE=${2:?--enable needs a list}; shift ;;
        --enable=*) ENABLE=${1#*=} ;;
        --with-vm) DO_VM=1 ;;
        --with-test-packages) TEST_PKGS=1 ;;
        --with-etcd) ETCD_PKGS=1 ;;
        --no-apt) DO_APT=0 ;;
        --no-criu) DO_CRIU=0 ;;
        --no-bundle) DO_BUNDLE=0 ;;
        --no-user) DO_USER=0 ;;
        --no-systemctl) DO_SYSTEMCTL=0 ;;
        --print-apt-packages) ACTION=print-apt ;;
        --uninstall) ACTION=uninstall ;;
        --purge) ACTION=purge ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

[[ $PREFIX == /* ]] || PREFIX="$PWD/$PREFIX"
[[ $ROOT == /* ]] || ROOT="$PWD/$ROOT"
PREFIX=${PREFIX%/}
ROOT=${ROOT%/}
# A path of the installed system: under --root when one is given.
at() { echo "${ROOT}$1"; }
LIBDIR=$PREFIX/lib/aenv
BINDIR=$PREFIX/bin
ETC=$(at /etc/aenv)
STATE=$(at /var/lib/aenv)
UNITDIR=$(at /etc/systemd/system)
OPT=$(at /opt/aenv)
BUNDLE=$OPT/runtime/py311
VMDIR=$OPT/vm/qemu
CRIU_PREFIX=$(at /usr/local)
ON_HOST=0
[[ -z $ROOT ]] && ON_HOST=1

apt_packages() {
    local line pkgs p skip t
    line=$(sed -n 's/^APT_PACKAGES[[:space:]]*:=[[:space:]]*//p' "$HERE/Makefile")
    [[ -n $line ]] || die "no APT_PACKAGES in $HERE/Makefile"
    read -r -a pkgs <<<"$line"
    for p in "${pkgs[@]}"; do
        skip=0
        if ((!TEST_PKGS)); then
            for t in "${APT_TEST_ONLY[@]}"; do [[ $p == "$t" ]] && skip=1; done
        fi
        if ((!ETCD_PKGS)); then
            for t in "${APT_ETCD[@]}"; do [[ $p == "$t" ]] && skip=1; done
        fi
        ((skip)) || echo "$p"
    done
    printf '%s\n' "${APT_OWN[@]}"
}

if [[ $ACTION == print-apt ]]; then
    apt_packages
    exit 0
fi
[[ $(id -u) -eq 0 ]] || die "must run as root (it installs units, a system user, root-owned state)"

CHANGED=0
UNCHANGED=0
# status: "unchanged" or what was done (wrote, updated, removed, ...)
report() {
    if [[ $1 == unchanged* ]]; then UNCHANGED=$((UNCHANGED + 1)); else CHANGED=$((CHANGED + 1)); fi
    log "$1: $2"
}

# stat as "mode uid gid", e.g. "644 0 0"
meta() { stat -c '%a %u %g' "$1"; }

# install_file SRC DEST MODE UID GID: DEST gets SRC's bytes and that mode/owner.
install_file() {
    local src=$1 dest=$2 mode=$3 uid=$4 gid=$5 tmp
    if [[ -f $dest && ! -L $dest ]] && cmp -s "$src" "$dest"; then
        if [[ $(meta "$dest") == "$(printf '%o' $((8#$mode))) $uid $gid" ]]; then
            report unchanged "$dest"
            return
        fi
        chown "$uid:$gid" "$dest"
        chmod "$mode" "$dest"
        report "updated mode/owner" "$dest"
        return
    fi
    local what=wrote
    [[ -e $dest ]] && what=updated
    mkdir -p "$(dirname "$dest")"
    tmp=$(mktemp "$dest.tmp.XXXXXX")
    cat "$src" >"$tmp"
    chown "$uid:$gid" "$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$dest"
    report "$what" "$dest"
}

# install_conffile SRC DEST MODE UID GID: like install_file, but a DEST that differs from SRC
# was edited by the operator: it is kept (its mode/owner set), SRC goes to DEST.dist.
install_conffile() {
    local src=$1 dest=$2 mode=$3 uid=$4 gid=$5
    if [[ -f $dest ]] && ! cmp -s "$src" "$dest"; then
        if [[ $(meta "$dest") != "$(printf '%o' $((8#$mode))) $uid $gid" ]]; then
            chown "$uid:$gid" "$dest"
            chmod "$mode" "$dest"
            report "kept (locally changed), updated mode/owner" "$dest"
        else
            report "unchanged (locally changed, kept)" "$dest"
        fi
        install_file "$src" "$dest.dist" "$mode" "$uid" "$gid"
        return
    fi
    install_file "$@"
}

# ensure_dir DIR MODE UID GID
ensure_dir() {
    local dir=$1 mode=$2 uid=$3 gid=$4 m
    m=$(printf '%o' $((8#$mode)))
    if [[ -d $dir && ! -L $dir ]]; then
        if [[ $(meta "$dir") == "$m $uid $gid" ]]; then
            report unchanged "$dir/"
        else
            chown "$uid:$gid" "$dir"
            chmod "$mode" "$dir"
            report "updated mode/owner" "$dir/"
        fi
        return
    fi
    mkdir -p "$dir"
    chown "$uid:$gid" "$dir"
    chmod "$mode" "$dir"
    report created "$dir/"
}

# ensure_symlink TARGET LINK
ensure_symlink() {
    local target=$1 link=$2
    if [[ -L $link && $(readlink "$link") == "$target" ]]; then
        report unchanged "$link"
        return
    fi
    [[ -e $link && ! -L $link ]] && die "$link exists and is not a symlink: not replacing it"
    mkdir -p "$(dirname "$link")"
    ln -sfn "$target" "$link.tmp.$$"
    mv -Tf "$link.tmp.$$" "$link"
    report linked "$link -> $target"
}

remove_path() {
    if [[ -e $1 || -L $1 ]]; then
        rm -rf --one-file-system "$1"
        report removed "$1"
    fi
}

# -- the aenv user -----------------------------------------------------------------------------
passwd_has() { # passwd|group NAME
    if ((ON_HOST)); then getent "$1" "$2" >/dev/null; else grep -q "^$2:" "$(at "/etc/$1")" 2>/dev/null; fi
}
aenv_gid() {
    if ((ON_HOST)); then getent group aenv | cut -d: -f3; else awk -F: '$1 == "aenv" {print $3}' "$(at /etc/group)"; fi
}
ensure_user() {
    if passwd_has passwd aenv; then
        report unchanged "user aenv"
        return
    fi
    local args=(--system --user-group --home-dir /nonexistent --no-create-home
                --shell /usr/sbin/nologin --comment "aenv gateway and scheduler")
    if ((ON_HOST)); then
        useradd "${args[@]}" aenv
    elif [[ -f $(at /etc/passwd) && -f $(at /etc/group) ]]; then
        useradd --prefix "$ROOT" "${args[@]}" aenv
    else
        log "skipped: user aenv (no $(at /etc/passwd))"
        return
    fi
    report created "user aenv"
}
remove_user() {
    passwd_has passwd aenv || return 0
    if ((ON_HOST)); then userdel aenv; else userdel --prefix "$ROOT" aenv; fi
    if passwd_has group aenv; then
        if ((ON_HOST)); then groupdel aenv; else groupdel --prefix "$ROOT" aenv; fi
    fi
    report removed "user aenv"
}

# -- steps -------------------------------------------------------------------------------------
check_host() {
    if [[ -r /etc/os-release ]]; then
        local id ver
        id=$(sed -n 's/^ID=//p' /etc/os-release | tr -d '"')
        ver=$(sed -n 's/^VERSION_ID=//p' /etc/os-release | tr -d '"')
        case "$id $ver" in
            "debian 12"|"ubuntu 24.04") ;;
            *) log "warning: tested on Debian 12 and Ubuntu 24.04 only (this is $id $ver)" ;;
        esac
    fi
    local c missing=()
    for c in memory cpu cpuacct pids freezer devices; do
        [[ -f /sys/fs/cgroup/$c/cgroup.procs ]] || missing+=("$c")
    done
    if ((${#missing[@]})); then
        log "warning: cgroup v1 controllers not mounted: ${missing[*]}. The container runtime needs"
        log "  them: boot with systemd.unified_cgroup_hierarchy=0 (docs/deploy.md), or use"
        log "  runtime.driver = \"qemu\" (--with-vm)."
    fi
}

install_apt() {
    local pkgs=() missing=() p alt
    mapfile -t pkgs < <(apt_packages)
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" && continue
        # Ubuntu 24.04 renamed some libraries for 64-bit time_t (libfuse2 -> libfuse2t64).
        alt=${p}t64
        if dpkg-query -W -f='${Status}' "$alt" 2>/dev/null | grep -q "ok installed"; then continue; fi
        missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        report unchanged "apt packages (${#pkgs[@]})"
        return
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    local resolved=()
    for p in "${missing[@]}"; do
        if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]' \
           && apt-cache policy "${p}t64" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
            resolved+=("${p}t64")
        else
            resolved+=("$p")
        fi
    done
    apt-get install -y -qq --no-install-recommends "${resolved[@]}" >/dev/null
    report installed "apt packages: ${resolved[*]}"
}

find_python() {
    if [[ -z $PYTHON ]]; then
        if [[ -x /usr/bin/python3.11 ]]; then PYTHON=/usr/bin/python3.11
        else PYTHON=$(command -v python3.11 || true)
        fi
    fi
    [[ -n $PYTHON && -x $PYTHON ]] || die "Python 3.11 not found (aenv needs exactly 3.11; on Ubuntu 24.04 install python3.11, e.g. from the deadsnakes PPA, and pass --python)"
    "$PYTHON" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' \
        || die "$PYTHON is not Python 3.11 with the venv module"
}

# The virtualenv is named after a hash of what goes into it: same sources, same directory.
source_hash() {
    {
        "$PYTHON" -c 'import sys; print(sys.version)'
        sha256sum "$HERE/pyproject.toml" | cut -d' ' -f1
        (cd "$HERE" && find src -name __pycache__ -prune -o -name '*.egg-info' -prune -o -type f -print \
            | LC_ALL=C sort | xargs -d '\n' sha256sum)
    } | sha256sum | cut -c1-16
}

install_venv() {
    local hash venv old tmp
    hash=$(source_hash)
    venv=$LIBDIR/venv-$hash
    if [[ -f $venv/.complete && -x $venv/bin/aenv ]]; then
        report unchanged "$venv/"
    else
        log "building $venv (pip install from $HERE)"
        rm -rf "$venv"
        mkdir -p "$LIBDIR"
        tmp=$(mktemp -d /tmp/aenv-install.XXXXXX)
        # A copy of the sources: pip builds in the tree it is given.
        tar -C "$HERE" --exclude=__pycache__ --exclude='*.egg-info' -cf - pyproject.toml src | tar -C "$tmp" -xf -
        if ! { "$PYTHON" -m venv "$venv" \
               && "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-warn-script-location "$tmp"; }; then
            rm -rf "$venv" "$tmp"
            die "pip install failed"
        fi
        rm -rf "$tmp"
        "$venv/bin/aenv" --help >/dev/null || { rm -rf "$venv"; die "$venv/bin/aenv does not run"; }
        touch "$venv/.complete"
        report built "$venv/"
    fi
    old=$(readlink "$LIBDIR/current" 2>/dev/null || true)
    if [[ -n $old && $old != "venv-$hash" ]]; then
        ensure_symlink "$old" "$LIBDIR/previous"
    fi
    ensure_symlink "venv-$hash" "$LIBDIR/current"
    # Older venvs than the previous one are no longer referenced by anything.
    local keep_prev d
    keep_prev=$(readlink "$LIBDIR/previous" 2>/dev/null || true)
    for d in "$LIBDIR"/venv-*; do
        [[ -d $d ]] || continue
        case "$(basename "$d")" in "venv-$hash"|"$keep_prev") ;; *) remove_path "$d" ;; esac
    done
    ensure_symlink ../lib/aenv/current/bin/aenv "$BINDIR/aenv"
    install_file "$HERE/deploy/bin/aenv-health" "$LIBDIR/aenv-health" 0755 0 0
}

install_criu() {
    local id_file=$CRIU_PREFIX/share/aenv/criu-build-id before after
    before=$(cat "$id_file" 2>/dev/null || true)
    [[ -x $CRIU_PREFIX/sbin/criu ]] || : >"$LIBDIR/.criu-installed-here"
    CRIU_PREFIX=$CRIU_PREFIX bash "$HERE/scripts/install-criu.sh"
    after=$(cat "$id_file" 2>/dev/null || true)
    if [[ $before == "$after" ]]; then report unchanged "$CRIU_PREFIX/sbin/criu"; else report built "$CRIU_PREFIX/sbin/criu ($after)"; fi
}

install_bundle() {
    local out
    out=$("$LIBDIR/current/bin/python" -m aenv.runtime.pybundle build --dest "$BUNDLE")
    if [[ $out == *" 0 written, "*" 0 removed"* ]]; then report unchanged "$BUNDLE/"; else report built "$BUNDLE/ (${out#*: })"; fi
}

install_vm() {
    local before after
    before=$(readlink "$VMDIR/current" 2>/dev/null || true)
    PY="$LIBDIR/current/bin/python" AENV_VM_DIR="$VMDIR" bash "$HERE/scripts/install-vm.sh"
    after=$(readlink "$VMDIR/current" 2>/dev/null || true)
    if [[ $before == "$after" ]]; then report unchanged "$VMDIR/"; else report built "$VMDIR/ ($after)"; fi
}

install_units() {
    local u tmp
    tmp=$(mktemp -d /tmp/aenv-units.XXXXXX)
    for u in "${UNITS[@]}"; do
        sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@LIBDIR@|$LIBDIR|g" -e "s|@PYTHON@|$LIBDIR/current/bin/python|g" \
            "$HERE/deploy/systemd/$u.service.in" >"$tmp/$u.service"
        install_file "$tmp/$u.service" "$UNITDIR/$u.service" 0644 0 0
    done
    rm -rf "$tmp"
}

systemctl_ok() {
    ((DO_SYSTEMCTL && ON_HOST)) && [[ -d /run/systemd/system ]]
}

do_install() {
    check_host
    ((DO_APT)) && install_apt
    find_python
    ((DO_USER)) && ensure_user
    local gid=0 conf_mode=0644
    if passwd_has group aenv; then gid=$(aenv_gid); conf_mode=0640; fi
    ensure_dir "$ETC" 0755 0 0
    install_conffile "$HERE/deploy/config.toml" "$ETC/config.toml" "$conf_mode" 0 "$gid"
    install_conffile "$HERE/deploy/aenv.env" "$ETC/aenv.env" 0600 0 0
    ensure_dir "$STATE" 0700 0 0
    install_venv
    ((DO_CRIU)) && install_criu
    ((DO_BUNDLE)) && install_bundle
    ((DO_VM)) && install_vm
    local before=$CHANGED
    install_units
    if systemctl_ok; then
        ((CHANGED > before)) && systemctl daemon-reload && log "systemctl daemon-reload"
        if [[ -n $ENABLE ]]; then
            local u
            for u in ${ENABLE//,/ }; do
                systemctl enable --now "$u.service"
                log "enabled and started: $u.service"
            done
        fi
        if systemctl is-active -q aenv.service 2>/dev/null && ((CHANGED > 0)); then
            log "aenv.service is running the old version: 'systemctl restart aenv' (running sandboxes are kept)"
        fi
    elif [[ -n $ENABLE ]]; then
        log "not enabling $ENABLE: no systemctl (--no-systemctl, --root, or systemd not running)"
    fi
}

do_uninstall() {
    local u
    if systemctl_ok; then
        for u in "${UNITS[@]}"; do
            if systemctl list-unit-files "$u.service" >/dev/null 2>&1; then
                systemctl disable --now "$u.service" >/dev/null 2>&1 || true
            fi
        done
    fi
    for u in "${UNITS[@]}"; do remove_path "$UNITDIR/$u.service"; done
    systemctl_ok && systemctl daemon-reload
    if [[ -L $BINDIR/aenv ]]; then remove_path "$BINDIR/aenv"; fi
    if [[ -f $LIBDIR/.criu-installed-here ]]; then
        remove_path "$CRIU_PREFIX/sbin/criu"
        remove_path "$CRIU_PREFIX/share/aenv/criu-build-id"
        rmdir "$CRIU_PREFIX/share/aenv" 2>/dev/null || true
    fi
    remove_path "$LIBDIR"
    log "kept: $ETC/, $STATE/, $OPT/ (--purge removes them); apt packages are never removed"
}

do_purge() {
    if [[ -d $STATE ]] && awk -v d="$STATE" '$5 == d || index($5, d "/") == 1 {found=1} END {exit !found}' /proc/self/mountinfo; then
        die "something is mounted below $STATE (the managed volume?): stop aenv.service, remove the sandboxes, umount it first"
    fi
    do_uninstall
    remove_path "$ETC"
    remove_path "$STATE"
    remove_path "$(at /var/lib/aenv-gateway)"
    remove_path "$(at /var/lib/aenv-scheduler)"
    remove_path "$OPT"
    ((DO_USER)) && remove_user
    return 0
}

case "$ACTION" in
    install) do_install ;;
    uninstall) do_uninstall ;;
    purge) do_purge ;;
esac
if ((CHANGED == 0)); then
    log "nothing changed ($UNCHANGED unchanged)"
else
    log "$CHANGED changed, $UNCHANGED unchanged"
fi
