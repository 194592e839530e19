"""The default `base` template: a minimal Debian 12 with bash, coreutils, python3, git, curl,
procps and sudo, plus the E2B-style default user `user` (uid 1000, home /home/user,
passwordless sudo). Built by debootstrap on first use and cached as a read-only layer.

The build happens in a temporary directory renamed into place at the end, so a crash never
leaves a half-built layer visible.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.progress import ProgressBar

SUITE = "bookworm"
MIRROR = os.environ.get("AENV_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("bash", "coreutils", "python3", "git", "curl", "procps", "ca-certificates", "sudo",
            "iproute2", "less")
DEFAULT_USER = "user"
# Directories the runtimes bind-mount into every sandbox; present in the layer so that a
# sandbox's writable upper does not have to create them.
MOUNTPOINTS = ("opt/aenv/runtime/py311",)
_RECIPE_VERSION = "3"

_STEP = re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) (\S+)")
# Weight of each debootstrap phase in the bar; one package passes through several phases.
_PHASE_WEIGHT = {"Retrieving": 0.30, "Validating": 0.05, "Extracting": 0.15,
                 "Unpacking": 0.20, "Configuring": 0.25}


def base_layer_id() -> str:
    recipe = "|".join((_RECIPE_VERSION, SUITE, ",".join(PACKAGES), DEFAULT_USER, *MOUNTPOINTS))
    return "debian-" + SUITE + "-" + hashlib.sha256(recipe.encode()).hexdigest()[:12]


def build_base_layer(layers_dir: Path, cache_dir: Path, show_progress: bool = True) -> Path:
    """Return the base layer directory, building it if it is not there yet."""
    final = layers_dir / base_layer_id()
    if (final / "etc/os-release").exists():
        return final
    if shutil.which("debootstrap") is None:
        raise AenvError(ErrorCode.UNAVAILABLE,
                        "debootstrap is not installed: run `make install` (apt-get install debootstrap)")
    layers_dir.mkdir(parents=True, exist_ok=True)
    debs = cache_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    # debootstrap opens the target's own /dev/null inside its chroot, which a `nodev` mount
    # refuses, and sandbox storage (layers/ included) is mounted nosuid,nodev
    # (docs/security.md): the layer is built in a private directory on the host's /var/tmp
    # and copied into layers/ once, then renamed into place.
    build_root = Path(tempfile.mkdtemp(prefix=f"aenv-{final.name}-", dir="/var/tmp"))
    tmp = build_root / "root"
    staged = layers_dir / f".build-{final.name}-{os.getpid()}"
    shutil.rmtree(staged, ignore_errors=True)
    bar = ProgressBar("building template base", total=1.0) if show_progress else None
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
           f"--cache-dir={debs}", SUITE, str(tmp), MIRROR]
    log: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        seen: dict[str, set[str]] = {phase: set() for phase in _PHASE_WEIGHT}
        for line in proc.stdout:
            log.append(line)
            m = _STEP.match(line)
            if m and bar is not None:
                seen[m.group(1)].add(m.group(2))
                # Retrieving lists every package first, so it is our estimate of the total.
                total = max(len(seen["Retrieving"]), 1)
                done = sum(w * min(len(seen[p]) / total, 1.0) for p, w in _PHASE_WEIGHT.items())
                bar.update(min(done, 0.95), f"{m.group(1).lower()} {m.group(2)}")
        if proc.wait() != 0:
            tail = "".join(log[-15:])
            raise AenvError(ErrorCode.INTERNAL, f"debootstrap failed (exit {proc.returncode}):\n{tail}")
        _customise(tmp)
        copied = subprocess.run(["cp", "-a", "--reflink=auto", str(tmp), str(staged)],
                                capture_output=True, text=True, check=False)
        if copied.returncode != 0:
            raise AenvError(ErrorCode.INTERNAL,
                            f"copying the base layer into {layers_dir}: {copied.stderr.strip()}")
        try:
            os.replace(staged, final)
        except OSError:
            # Another builder finished first; theirs is as good as ours.
            if not (final / "etc/os-release").exists():
                raise

    finally:
        shutil.rmtree(build_root, ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)
    if bar is not None:
        bar.finish()
    return final


def _chroot(root: Path, *args: str) -> None:
    res = subprocess.run(["chroot", str(root), *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL, f"{' '.join(args)} failed in the base layer: {res.stderr}")


def _customise(root: Path) -> None:
    _chroot(root, "useradd", "--create-home", "--uid", "1000", "--shell", "/bin/bash", DEFAULT_USER)
    sudoers = root / "etc/sudoers.d/user"
    sudoers.write_text(f"{DEFAULT_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    sudoers.chmod(0o440)
    for mp in MOUNTPOINTS:
        (root / mp).mkdir(parents=True, exist_ok=True)
    (root / "etc/hostname").write_text("sandbox\n")
    # apt's lists and caches are not needed at run time and make every sandbox's view larger.
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (root / junk).glob("*.deb"):
            entry.unlink()
