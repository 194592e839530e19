"""The built-in `code-interpreter-v1` template: what `e2b-code-interpreter`'s `Sandbox.create()`
asks for, built by the project on first use and cached as a template afterwards.

Owns: the template's recipe (the pinned Python packages, the in-sandbox server `server.py`,
the steps that install them into a venv on the base template's Debian python3 3.11) and the
wheelhouse: sandboxes cannot reach package registries, so the host downloads the wheels with
pip (for CPython 3.11 manylinux x86_64, whatever the host runs) into
`cache/wheelhouse/<recipe>/`, once, and the build installs them from there with `--no-index`.
The build itself is an ordinary template build (`TemplateBuilds`: COPY, RUN, start command,
ready command, snapshot), so creating from the template is a CRIU restore of a sandbox whose
kernel is already running.
Must not touch: sandboxes beyond `TemplateBuilds`' pipeline; templates other than its own (a
template the user built under the same name is left alone).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from aenv.builds.builder import BuildSpec, Step, TemplateBuilds
from aenv.errors import AenvError, ErrorCode

log = logging.getLogger("aenv.builds.code_interpreter")

TEMPLATE_NAME = "code-interpreter-v1"
# The second name marks a template as ours and says which recipe built it: a template named
# TEMPLATE_NAME without it was built by someone else and is used as it is.
RECIPE_NAME_PREFIX = "aenv-code-interpreter-"
SERVER_SOURCE = Path(__file__).with_name("server.py")
INSTALL_DIR = "/usr/local/lib/aenv-code-interpreter"
BUILD_DIR = "/tmp/aenv-code-interpreter-build"
# Every package pinned, dependencies included, so one recipe always installs the same files.
REQUIREMENTS = (
    "ipykernel==6.31.0", "jupyter_client==8.10.0", "ipython==9.18.1", "pyzmq==27.3.0",
    "tornado==6.6.1", "traitlets==5.16.1", "jupyter_core==5.9.1", "comm==0.2.3",
    "debugpy==1.8.22", "matplotlib-inline==0.2.2", "nest-asyncio==1.6.0", "psutil==7.2.2",
    "packaging==26.4", "platformdirs==4.14.9", "python-dateutil==4.0.0", "pexpect==4.9.0",
    "ptyprocess==0.7.0", "prompt_toolkit==3.0.53", "pygments==2.21.0", "jedi==0.20.1",
    "parso==0.8.7", "stack_data==0.6.3", "asttokens==3.0.2", "executing==2.3.0",
    "pure-eval==0.2.4", "wcwidth==0.9.4", "ipython-pygments-lexers==1.1.1",
    "typing-extensions==4.16.0",
    "numpy==2.3.5", "pandas==2.2.3", "pytz==2026.6", "tzdata==2026.6",
    "matplotlib==3.10.9", "contourpy==1.3.3", "cycler==0.12.1", "fonttools==4.68.0",
    "kiwisolver==1.5.1", "pillow==12.3.0", "pyparsing==3.3.3",
    "bash_kernel==0.10.0", "filetype==1.2.0",  # language "bash"
    "pip==26.3",
)
# The template's Python: CPython 3.11 on glibc x86_64 (Debian 12's python3 in `base`).
TARGET = ("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
          "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
          "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
          "--platform", "linux_x86_64")
_RECIPE_VERSION = "1"
PIP_DOWNLOAD_TIMEOUT_S = 1800


def recipe_id() -> str:
    """Changes whenever what the template contains would."""
    digest = hashlib.sha256()
    for part in (_RECIPE_VERSION, INSTALL_DIR, *REQUIREMENTS, *TARGET):
        digest.update(part.encode() + b"\0")
    digest.update(SERVER_SOURCE.read_bytes())
    return digest.hexdigest()[:12]


def wheelhouse_dir(cache_dir: Path) -> Path:
    """Keyed by the packages only: a change to the server does not download them again."""
    digest = hashlib.sha256("\0".join((*REQUIREMENTS, *TARGET)).encode()).hexdigest()[:12]
    return cache_dir / "wheelhouse" / digest


def download_wheels(cache_dir: Path) -> Path:
    """The wheelhouse of this recipe, downloaded with pip on the host if it is not there yet.
    Blocking; call it in a thread."""
    final = wheelhouse_dir(cache_dir)
    if (final / "requirements.txt").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
               "--no-input", "--only-binary=:all:", *TARGET, "--dest", str(tmp), *REQUIREMENTS]
        log.info("downloading the code interpreter's wheels: %s", " ".join(REQUIREMENTS))
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                 timeout=PIP_DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AenvError(ErrorCode.UNAVAILABLE, "pip download of the code interpreter's "
                            f"wheels took longer than {PIP_DOWNLOAD_TIMEOUT_S}s") from None
        if res.returncode != 0:
            tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"pip download of the code interpreter's wheels failed:\n{tail}")
        # Written last: its presence says the wheelhouse is complete.
        (tmp / "requirements.txt").write_text("\n".join(REQUIREMENTS) + "\n")
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "requirements.txt").exists():  # else another download won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_context(wheelhouse: Path, out: Path) -> str:
    """The build context archive (`wheels/`, `server.py`) at `out`; its sha256."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    with tarfile.open(tmp, "w") as tar:
        for wheel in sorted(wheelhouse.iterdir()):
            tar.add(wheel, f"wheels/{wheel.name}", recursive=False)
        data = SERVER_SOURCE.read_bytes()
        info = tarfile.TarInfo("server.py")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256()
    with tmp.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    os.replace(tmp, out)
    return digest.hexdigest()


def build_spec(files_hash: str, pip_wheel: str) -> BuildSpec:
    venv = f"{INSTALL_DIR}/venv"
    install = " && ".join((
        f"python3 -m venv --without-pip {venv}",
        # pip runs from its own wheel (Debian's python3 has no ensurepip): nothing but the
        # wheelhouse is used, and no registry is asked.
        (f"{venv}/bin/python {BUILD_DIR}/wheels/{pip_wheel}/pip install --no-index "
         f"--disable-pip-version-check --no-cache-dir --find-links {BUILD_DIR}/wheels "
         f"-r {BUILD_DIR}/wheels/requirements.txt"),
        f"{venv}/bin/python -m bash_kernel.install --sys-prefix",
        # the packages' own test suites (pandas', numpy's: ~60 MB) are never imported; left
        # out, the template's sealed layer is smaller and its push to the repository shorter
        (f"find {venv}/lib -depth -type d -name tests -path '*/site-packages/*' "
         "-exec rm -rf {} +"),
        f"install -m 0644 {BUILD_DIR}/server.py {INSTALL_DIR}/server.py",
        f"rm -rf {BUILD_DIR}",
    ))
    path = f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return BuildSpec(
        from_template="base",
        steps=[Step("COPY", [".", BUILD_DIR + "/", "root"], files_hash),
               Step("RUN", [install, "root"]),
               # `python3` in the sandbox is the kernel's, with pandas and matplotlib, as in E2B's
               Step("ENV", ["PATH", path]),
               Step("WORKDIR", ["/home/user"])],
        start_cmd=f"{venv}/bin/python {INSTALL_DIR}/server.py",
        ready_cmd="curl -sf http://127.0.0.1:49999/health",
    )


@dataclass
class CodeInterpreterTemplate:
    """Builds `code-interpreter-v1` when a create names it and it is missing (or was built
    by an older recipe of ours); concurrent creates wait for the same build."""

    builds: TemplateBuilds
    _lock: asyncio.Lock | None = None

    async def ensure(self, name: str) -> None:
        if name != TEMPLATE_NAME:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self._needs_build():
                return
            await self._build()

    async def prebuild(self) -> None:
        """`ensure()` at server start, in the background: a failure is logged, not raised
        (the next create that names the template tries again)."""
        try:
            await self.ensure(TEMPLATE_NAME)
        except AenvError as exc:
            log.warning("template %s could not be built: %s", TEMPLATE_NAME, exc.message)

    def _needs_build(self) -> bool:
        store = self.builds.manager.store
        current = store.find_template(TEMPLATE_NAME)
        if current is None:
            return True
        ours = [n for n in current.names if n.startswith(RECIPE_NAME_PREFIX)]
        return bool(ours) and RECIPE_NAME_PREFIX + recipe_id() not in ours

    async def _build(self) -> None:
        layout = self.builds.layout
        log.info("building template %s (first use; cached afterwards)", TEMPLATE_NAME)
        wheelhouse = await asyncio.to_thread(download_wheels, layout.cache_dir)
        defaults = self.builds.config.sandbox
        tpl, build = self.builds.request(TEMPLATE_NAME, [], defaults.cpu_count,
                                         defaults.memory_mb)
        marker = RECIPE_NAME_PREFIX + recipe_id()
        tpl.names = [TEMPLATE_NAME, marker]
        staging = self.builds.files_dir / tpl.template_id / ".context.tar"
        await asyncio.to_thread(staging.parent.mkdir, parents=True, exist_ok=True)
        files_hash = await asyncio.to_thread(write_context, wheelhouse, staging)
        await asyncio.to_thread(staging.replace, self.builds.files_path(tpl.template_id,
                                                                        files_hash))
        pip_wheel = next(w.name for w in wheelhouse.glob("pip-*.whl"))
        started = self.builds.start(tpl.template_id, build.build_id,
                                    build_spec(files_hash, pip_wheel))
        assert started.task is not None
        shown = 0
        while not started.task.done():
            await asyncio.wait({started.task}, timeout=1.0)
            for entry in started.logs[shown:]:
                log.info("[%s] %s", entry.step or "-", entry.message)
            shown = len(started.logs)
        if started.status != "ready":
            reason = (started.reason or {}).get("message", "unknown error")
            tail = "\n".join(e.message for e in started.logs[-12:-1])
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"building template {TEMPLATE_NAME} failed: {reason}\n{tail}")
        log.info("template %s is ready", TEMPLATE_NAME)
