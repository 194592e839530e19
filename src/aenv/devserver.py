"""Run an `aenv serve` process and wait until it is ready: for the demo, tests and benchmarks.

Not used by the server itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self


@dataclass(frozen=True)
class S3Server:
    """Where an S3-compatible server (the tests' moto) listens, and its bucket."""

    endpoint: str
    bucket: str
    region: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    home: Path
    port: int = field(default_factory=free_port)
    api_key: str = "aenv_test_key"
    extra_env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sdk_env(self) -> dict[str, str]:
        """Environment for the official E2B SDK to talk to this server."""
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url,
                "E2B_SANDBOX_URL": self.url, "NO_PROXY": "127.0.0.1,localhost"}

    def start(self, ready_timeout: float = 900.0, show_output: bool = False) -> Self:
        # Test and benchmark servers build code-interpreter-v1 only when a create asks for it.
        env = {"AENV_SANDBOX_CODE_INTERPRETER_PREBUILD": "0",
               **os.environ, "AENV_HOME": str(self.home), "AENV_API_KEY": self.api_key,
               **self.extra_env}
        self.home.mkdir(parents=True, exist_ok=True)
        out: int | IO[bytes] | None = None
        if not show_output:
            # kept open for the server's lifetime, closed by stop()
            self._log = open(self.log_path or self.home / "server.log", "ab")  # noqa: SIM115
            out = self._log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli.main", "serve", "--listen", f"127.0.0.1:{self.port}"],
            env=env, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aenv serve exited with {self.proc.returncode}; "
                                   f"see {self.log_path or self.home / 'server.log'}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 204:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"aenv serve not ready after {ready_timeout}s")

    def remove_all_sandboxes(self) -> None:
        """Sandboxes outlive their server by design (restarts re-attach), so test and
        benchmark runs remove what they made before stopping the server."""
        import httpx

        with httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key},
                          timeout=60) as http:
            for sbx in http.get("/v2/sandboxes", params={"limit": 1000}).json():
                http.delete(f"/sandboxes/{sbx['sandboxID']}")

    def shutdown(self) -> None:
        """Remove every sandbox (if the server still answers), then stop the server."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.remove_all_sandboxes()
        finally:
            self.stop()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        if self.proc is not None and self.proc.poll() is None:
            return self  # `with server.start(...):` already started it
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def run_with_server(prefix: str, title: str,
                    body: Callable[[ServerProcess], Iterable[str]]) -> int:
    """Benchmarks' frame: a fresh home and server, the SDK pointed at it, `body`'s lines
    printed as they come, and everything removed afterwards."""
    with sdk_server(prefix, ready_timeout=900.0) as server:
        print(title)
        for line in body(server):
            print("  " + line, flush=True)
    return 0


@contextlib.contextmanager
def own_server(prefix: str = "aenv-test-", extra_env: dict[str, str] | None = None,
               ready_timeout: float = 300.0, api_key: str = "aenv_test_key"
               ) -> Iterator[ServerProcess]:
    """A fresh home and a started server on it, for a test that needs a server configured its
    own way (the SDK's environment untouched: pass its url and key); afterwards the server
    and the home are removed."""
    home = prepare_home(prefix)
    server = ServerProcess(home=home, api_key=api_key, extra_env=extra_env or {})
    try:
        server.start(ready_timeout=ready_timeout)
        yield server
    finally:
        server.shutdown()
        remove_home(home)


@contextlib.contextmanager
def sdk_server(prefix: str = "aenv-test-", extra_env: dict[str, str] | None = None,
               ready_timeout: float = 300.0) -> Iterator[ServerProcess]:
    """Tests' and benchmarks' frame: `own_server` with the SDK's environment pointed at it;
    afterwards its sandboxes, the server, the environment change and the home are undone."""
    saved = dict(os.environ)
    try:
        with own_server(prefix, extra_env, ready_timeout) as server:
            os.environ.update(server.sdk_env())
            yield server
    finally:
        os.environ.clear()
        os.environ.update(saved)


def layer_cache() -> Path:
    return Path(os.environ.get("AENV_TEST_LAYER_CACHE", "/var/cache/aenv-test/layers"))


def base_layer() -> Path:
    """The base template layer, built once per machine into the test layer cache."""
    from aenv.images.base import build_base_layer

    cache = layer_cache()
    return build_base_layer(cache, cache.parent / "cache")


def prepare_home(prefix: str = "aenv-test-") -> Path:
    """A fresh AENV_HOME whose base layer is linked from a per-machine cache (built once),
    so that tests and benchmarks do not each pay for a debootstrap."""
    from aenv.storage.volume import btrfs_available, mount_btrfs_volume

    base = base_layer()
    home = Path(tempfile.mkdtemp(prefix=prefix))
    # On btrfs (a loop volume when the host filesystem is not), snapshots and forks seal a
    # sandbox's writable layer in O(1). AENV_TEST_FS=ext4 (or host) keeps the home on the
    # host filesystem, as a default install: the server then puts sandbox storage on its
    # managed volume (storage.volume = "auto"), or copies with AENV_STORAGE_VOLUME=off.
    if os.environ.get("AENV_TEST_FS", "btrfs") == "btrfs" and btrfs_available():
        mount_btrfs_volume(home)
    (home / "layers").mkdir()
    (home / "layers" / base.name).symlink_to(base)
    # The code interpreter template's wheels (pip download on the host), also once per machine.
    wheelhouse = layer_cache().parent / "cache" / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    (home / "cache").mkdir()
    (home / "cache" / "wheelhouse").symlink_to(wheelhouse)
    return home


def remove_home(home: Path) -> None:
    """Undo prepare_home()."""
    from aenv.storage.volume import detach_storage, unmount_volume

    detach_storage(home)  # the server's managed volume, if it made one
    unmount_volume(home)
    detach_storage(home)  # the volume again, if a mount over the home (a bind) hid it
    shutil.rmtree(home, ignore_errors=True)
