"""The self-contained Python runtime bundle that envd (and the container fork-server) run on.

Owns: the directory `/opt/aenv/runtime/py311/` (or `--dest`): the interpreter binary, libpython,
the glibc dynamic loader and every shared library the interpreter and its extension modules
need, the pure-python standard library (minus test suites, GUI and packaging tools), and a copy
of the stdlib-only parts of the `aenv` package that run inside sandboxes (`aenv/__init__.py`,
`aenv/envd/`, and the container fork-server modules).
Must not touch: anything outside the bundle directory, the host python it copies from.

Why a bundle: envd must run in arbitrary template userlands (Debian, Alpine/musl, busybox,
distroless), so it cannot use the template's libc or python. It is launched through the bundled
loader (`lib/ld-linux-x86-64.so.2 --library-path lib bin/python3.11`), so every file the
process maps comes from the bundle; the container driver bind-mounts the bundle read-only at
the same path inside each sandbox, which keeps every mapped file visible at an identical path
in the sandbox's mount namespace (what CRIU needs to checkpoint it later).

Building is idempotent: a manifest records the source (path, size, mtime) of every file, and
only changed files are rewritten, each one atomically (write a temporary file, then rename), so
sandboxes already mapping an old library keep their inode.

Usage (as root, from `make install`):  python -m aenv.runtime.pybundle build
"""

from __future__ import annotations

import argparse
import compileall
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

BUNDLE_DIR = Path("/opt/aenv/runtime/py311")
PY_VERSION = "3.11"
LOADER_NAME = "ld-linux-x86-64.so.2"
MANIFEST = "BUNDLE.json"
COMPLETE = ".complete"
APP_DIR = "app"  # holds the `aenv` package subset; put first on sys.path by launchers
FORMAT = 1  # bump when the layout changes

# Standard-library parts that are never needed by envd and only cost space.
_SKIP_STDLIB_DIRS = {
    "test", "site-packages", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
    "distutils", "pydoc_data", "__pycache__", "venv",
}
_SKIP_STDLIB_PREFIXES = ("config-",)  # config-3.11-x86_64-linux-gnu: static lib + Makefile
_SKIP_STDLIB_FILES = {"turtle.py", "antigravity.py", "this.py", "__hello__.py"}
# Extension modules left out: test modules, GUI, curses/readline (pull in ncurses), NIS
# (pulls in kerberos/tirpc), OSS audio.
_SKIP_EXT = re.compile(
    r"^(_test.*|_ctypes_test|_xxtestfuzz|_xxsubinterpreters|xxlimited.*|_tkinter|_curses.*|"
    r"readline|nis|ossaudiodev)\."
)
# Files of the aenv package copied into the bundle (relative to the package root). The two
# container modules are the fork-server; they are stdlib-only, like envd.
_APP_SUBPACKAGES = ("envd",)
_APP_FILES = ("__init__.py",)
_APP_CONTAINER_MODULES = ("linux.py", "zygote.py")
_STUB_INIT = '"""Bundle stub: only the stdlib-only modules used inside sandboxes live here."""\n'


def loader_path(bundle: Path = BUNDLE_DIR) -> Path:
    return bundle / "lib" / LOADER_NAME


def python_argv(bundle: Path = BUNDLE_DIR) -> list[str]:
    """argv prefix that runs the bundled interpreter without touching any file outside the
    bundle: the explicit loader (the template may have none, or musl's), the bundle's library
    directory first, and `-I -S` so neither the environment nor site-packages are consulted.
    Python finds its stdlib from argv[0] (`bin/python3.11` -> `lib/python3.11/os.py`)."""
    return [
        str(loader_path(bundle)), "--library-path", str(bundle / "lib"),
        str(bundle / "bin" / f"python{PY_VERSION}"), "-I", "-S",
    ]


def python_env() -> dict[str, str]:
    """Environment for a bundled interpreter. LC_ALL=C: glibc maps no locale or gconv file
    for the C locale (C.UTF-8 would map the host's /usr/lib/locale/C.utf8), and python turns
    on UTF-8 mode by itself in the C locale, so text is still UTF-8 everywhere."""
    return {"LC_ALL": "C", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


@dataclass
class BuildReport:
    dest: Path
    copied: int = 0
    unchanged: int = 0
    removed: int = 0
    size_bytes: int = 0
    errors: list[str] = field(default_factory=list)


def _ldd(path: Path) -> dict[str, Path]:
    """Shared libraries `path` needs, transitively, as resolved on the host: soname -> file."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False).stdout
    libs: dict[str, Path] = {}
    for line in out.splitlines():
        line = line.strip()
        m = re.match(r"^(\S+) => (/\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            libs[m.group(1)] = Path(m.group(2))
            continue
        m = re.match(r"^(/\S+) \(0x[0-9a-f]+\)$", line)  # the loader itself
        if m:
            libs[Path(m.group(1)).name] = Path(m.group(1))
    return libs


class _Builder:
    def __init__(self, dest: Path, prefix: Path, package_root: Path, strip: bool) -> None:
        self.dest = dest
        self.prefix = prefix
        self.package_root = package_root
        self.strip = strip and shutil.which("strip") is not None
        self.report = BuildReport(dest=dest)
        self.wanted: dict[str, tuple[str, int, int, bool]] = {}  # rel -> (src, size, mtime, elf)
        self.old: dict[str, list[object]] = {}
        self.generated: dict[str, str] = {}  # rel -> content for files we write ourselves

    def add(self, rel: str, src: Path, elf: bool = False) -> None:
        st = src.stat()  # follows symlinks: the bundle holds real files, never links
        self.wanted[rel] = (str(src), st.st_size, st.st_mtime_ns, elf)

    def collect(self) -> None:
        stdlib = self.prefix / "lib" / f"python{PY_VERSION}"
        if not (stdlib / "os.py").exists():
            raise SystemExit(f"pybundle: no python {PY_VERSION} stdlib under {self.prefix}")
        exe = self.prefix / "bin" / f"python{PY_VERSION}"
        self.add(f"bin/python{PY_VERSION}", exe, elf=True)
        elf_inputs = [exe]
        for root, dirs, files in os.walk(stdlib):
            rel_root = Path(root).relative_to(stdlib)
            dirs[:] = sorted(
                d for d in dirs
                if d not in _SKIP_STDLIB_DIRS and not d.startswith(_SKIP_STDLIB_PREFIXES)
            )
            for name in sorted(files):
                src = Path(root) / name
                rel = Path("lib") / f"python{PY_VERSION}" / rel_root / name
                if rel_root == Path("lib-dynload"):
                    if not name.endswith(".so") or _SKIP_EXT.match(name):
                        continue
                    self.add(str(rel), src, elf=True)
                    elf_inputs.append(src)
                elif name.endswith(".py") and name not in _SKIP_STDLIB_FILES:
                    self.add(str(rel), src)
        libs: dict[str, Path] = {}
        for path in elf_inputs:
            libs.update(_ldd(path))
        if LOADER_NAME not in libs:
            raise SystemExit(f"pybundle: ldd found no {LOADER_NAME} for {exe}")
        for soname, src in sorted(libs.items()):
            self.add(f"lib/{soname}", src, elf=True)
        # The aenv code that runs inside sandboxes.
        app = Path(APP_DIR) / "aenv"
        for name in _APP_FILES:
            self.add(str(app / name), self.package_root / name)
        for sub in _APP_SUBPACKAGES:
            base = self.package_root / sub
            for src in sorted(base.rglob("*.py")):
                if "__pycache__" in src.parts:
                    continue
                self.add(str(app / sub / src.relative_to(base)), src)
        self.generated[str(app / "runtime" / "__init__.py")] = _STUB_INIT
        self.generated[str(app / "runtime" / "container" / "__init__.py")] = _STUB_INIT
        for name in _APP_CONTAINER_MODULES:
            self.add(str(app / "runtime" / "container" / name),
                     self.package_root / "runtime" / "container" / name)

    def _write_atomic(self, rel: str, src: str | None, content: str | None, elf: bool,
                      mtime_ns: int) -> None:
        target = self.dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        if content is not None:
            tmp.write_text(content)
        else:
            assert src is not None
            shutil.copyfile(src, tmp)
            if elf and self.strip:
                # Debug info is most of libpython's 23 MiB; symbols stay for backtraces.
                subprocess.run(["strip", "--strip-debug", str(tmp)], check=False,
                               capture_output=True)
            os.chmod(tmp, 0o755 if elf else 0o644)
        # Keep the source mtime: timestamp-based .pyc files validate against it.
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, target)

    def sync(self) -> None:
        manifest_path = self.dest / MANIFEST
        try:
            data = json.loads(manifest_path.read_text())
            if data.get("format") == FORMAT:
                self.old = data.get("files", {})
        except (OSError, ValueError):
            self.old = {}
        self.dest.mkdir(parents=True, exist_ok=True)
        new_manifest: dict[str, list[object]] = {}
        for rel, (src, size, mtime, elf) in sorted(self.wanted.items()):
            entry: list[object] = [src, size, mtime]
            if self.old.get(rel) == entry and (self.dest / rel).exists():
                self.report.unchanged += 1
            else:
                self._write_atomic(rel, src, None, elf, mtime)
                self.report.copied += 1
            new_manifest[rel] = entry
        for rel, content in sorted(self.generated.items()):
            entry = ["<generated>", len(content), 0]
            target = self.dest / rel
            if target.exists() and target.read_text() == content:
                self.report.unchanged += 1
            else:
                self._write_atomic(rel, None, content, False, 0)
                self.report.copied += 1
            new_manifest[rel] = entry
        # Drop files a previous build wrote but this one does not want (and their .pyc).
        for rel in set(self.old) - set(new_manifest):
            stale = self.dest / rel
            if stale.exists():
                stale.unlink()
                self.report.removed += 1
            for pyc in (stale.parent / "__pycache__").glob(f"{stale.stem}.*.pyc"):
                pyc.unlink()
        # The bundle is mounted read-only in sandboxes: compile every module now, or each
        # import would recompile from source. Timestamp pycs match since mtimes are kept.
        for top in (self.dest / "lib" / f"python{PY_VERSION}", self.dest / APP_DIR):
            ok = compileall.compile_dir(str(top), quiet=2, workers=0, optimize=0,
                                        ddir=None, force=False)
            if not ok:
                self.report.errors.append(f"compileall failed under {top}")
        tmp = manifest_path.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "python": sys.version.split()[0],
                                   "files": new_manifest}, indent=0, sort_keys=True))
        os.replace(tmp, manifest_path)
        self.report.size_bytes = sum(
            f.stat().st_size for f in self.dest.rglob("*") if f.is_file() and not f.is_symlink()
        )


def default_prefix() -> Path:
    """The host python installation to copy: the one running this module (a venv's base)."""
    return Path(sys.base_prefix)


def bundle_id(dest: Path = BUNDLE_DIR) -> str | None:
    """The version of the bundle at `dest` (a digest of its manifest), None if it has none."""
    try:
        return hashlib.sha256((dest / MANIFEST).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def archived(dest: Path, version: str) -> Path:
    """Where the bundle version `version` of `dest` is kept once a rebuild replaced it."""
    return dest.with_name(f"{dest.name}-{version}")


def resolve(version: str, dest: Path = BUNDLE_DIR) -> Path | None:
    """The directory holding bundle version `version` (current or archived), or None."""
    if bundle_id(dest) == version:
        return dest
    old = archived(dest, version)
    return old if bundle_id(old) == version else None


def _archive(dest: Path) -> tuple[str, Path] | None:
    """Keep the current version of `dest` before a rebuild changes it: paused sandboxes and
    snapshots were taken with its exact files mapped, and CRIU restores them only with the
    same files. A tree of hard links (no data copied): the rebuild replaces files by rename,
    so the links keep the old contents."""
    version = bundle_id(dest)
    if version is None or not (dest / COMPLETE).exists():
        return None
    target = archived(dest, version)
    if target.exists():
        return None
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["cp", "-al", str(dest), str(tmp)], check=True, capture_output=True)
    os.replace(tmp, target)
    return version, target


def build(dest: Path = BUNDLE_DIR, prefix: Path | None = None, strip: bool = True) -> BuildReport:
    """Create or update the bundle at `dest`. Safe to run while sandboxes use it; the version
    it replaces stays available (`resolve()`) for paused sandboxes and snapshots."""
    if sys.version_info[:2] != (3, 11):
        raise SystemExit("pybundle: must run on python 3.11 (the .pyc files are version-bound)")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") not in (1, "1"):
        raise SystemExit("pybundle: the source python must be built with --enable-shared")
    package_root = Path(__file__).resolve().parent.parent  # src/aenv
    builder = _Builder(dest, prefix or default_prefix(), package_root, strip)
    builder.collect()
    # One build at a time on a host: servers starting together (a cluster of nodes on one
    # machine) each rebuild the same bundle, and two archives of one version collide.
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.build-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = _archive(dest)
        builder.sync()
        if kept is not None and bundle_id(dest) == kept[0]:
            shutil.rmtree(kept[1])  # nothing changed: no old version to keep
    return builder.report


def check(dest: Path = BUNDLE_DIR) -> None:
    """Run the bundled interpreter once; raise SystemExit if it cannot import envd's needs."""
    code = ("import sys, asyncio, json, ssl, hashlib, ctypes, sqlite3, zlib, lzma, bz2; "
            f"sys.path.insert(0, {str(dest / APP_DIR)!r}); import aenv.envd.settings; "
            "print(sys.prefix)")
    proc = subprocess.run([*python_argv(dest), "-c", code], capture_output=True, text=True,
                          env=python_env(), check=False)
    if proc.returncode != 0 or proc.stdout.strip() != str(dest):
        raise SystemExit(f"pybundle: bundled python does not work:\n{proc.stdout}{proc.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.runtime.pybundle")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="create or update the bundle (idempotent)")
    b.add_argument("--dest", type=Path, default=BUNDLE_DIR)
    b.add_argument("--prefix", type=Path, default=None, help="source python (default: this one)")
    b.add_argument("--no-strip", action="store_true")
    c = sub.add_parser("check", help="run the bundled python once")
    c.add_argument("--dest", type=Path, default=BUNDLE_DIR)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        report = build(args.dest, args.prefix, strip=not args.no_strip)
        check(args.dest)
        (args.dest / COMPLETE).touch()  # the Makefile's stamp
        print(f"pybundle: {report.dest}: {report.copied} written, {report.unchanged} unchanged, "
              f"{report.removed} removed, {report.size_bytes / 2**20:.1f} MiB")
        for err in report.errors:
            print(f"pybundle: {err}", file=sys.stderr)
        return 1 if report.errors else 0
    check(args.dest)
    print(f"pybundle: {args.dest} ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
