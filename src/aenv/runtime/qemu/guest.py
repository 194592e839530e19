"""PID 1 of a qemu sandbox, after the initramfs has mounted the root and tools disks.

Runs inside the guest on the bundled Python from the tools image (standard library only; it
is copied into the tools image, not imported by the server).
Owns, inside the guest: /dev/pts, /dev/shm, /run (tmpfs), the hostname, /etc/hostname,
/etc/hosts, /etc/resolv.conf (bind mounts of files on /run), the clock and the kernel's
entropy pool; then it becomes envd.
Must not touch: anything else of the template's root filesystem.

The host talks to it over the virtio-serial port `aenv.ctl` (never over the network, which
sandbox code and published ports share): one JSON object per line each way. The driver keeps
its end connected while the VM runs, so that the guest's reader blocks instead of polling.
- `config` (once, at boot): identity + envd's settings, including its access token (secrets
  never go on the kernel command line: /proc/cmdline is world-readable).
- `identity` (after a resume or a restore from a snapshot): new hostname, hosts, the host's
  wall clock (a restored guest's clock stands where it was captured) and fresh entropy (a
  forked child must not share its parent's random state).
Replies: {"id": N, "ok": true} or {"id": N, "ok": false, "error": "..."}.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

TOOLS = os.path.dirname(os.path.abspath(__file__))
CTL_NAME = "aenv.ctl"
RUN_DIR = "/run/aenv"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND = 2, 4, 8, 4096
# The files a new identity rewrites. Each becomes a bind mount of a file on the /run tmpfs, as
# in Docker: a restored child rewrites them in memory, not on its copy-on-write disk, where
# ext4's journal and the qcow2 overlay's first allocations cost it 60-70 ms under TCG.
IDENTITY_FILES = ("hostname", "hosts", "resolv.conf")


def _log(msg: str) -> None:
    sys.stderr.write(f"aenv-guest: {msg}\n")
    sys.stderr.flush()


def _uptime() -> str:
    with open("/proc/uptime") as f:
        return f.read().split()[0]


def _mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if not os.path.exists(target):
        os.makedirs(target)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                  data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def setup_mounts() -> None:
    _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "mode=0620,ptmxmode=0666,gid=5")
    _mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    _mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    os.makedirs(RUN_DIR, 0o700, exist_ok=True)
    os.makedirs("/run/lock", 0o1777, exist_ok=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        path = f"/dev/{name}"
        if not os.path.lexists(path):
            os.symlink(target, path)
    if not os.path.lexists("/dev/ptmx"):
        os.symlink("pts/ptmx", "/dev/ptmx")


def bind_identity_files() -> None:
    """/etc/<name> for each of IDENTITY_FILES becomes a bind mount of /run/aenv/etc/<name>,
    starting with the template's content. A file that cannot be bound stays on disk and is
    written there (slower, same result)."""
    if not os.path.isdir("/etc"):
        return
    os.makedirs(f"{RUN_DIR}/etc", 0o755, exist_ok=True)
    for name in IDENTITY_FILES:
        target, source = f"/etc/{name}", f"{RUN_DIR}/etc/{name}"
        try:
            content = b""
            if os.path.isfile(target):
                with open(target, "rb") as f:
                    content = f.read()
            if os.path.islink(target) or not os.path.exists(target):
                # A symlink (often into a /run the guest does not have) or nothing: a regular
                # file to mount over, made once at boot.
                if os.path.lexists(target):
                    os.unlink(target)
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
            fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, content)
            finally:
                os.close(fd)
            _mount(source, target, "", MS_BIND)
        except OSError as exc:
            _log(f"/etc/{name} stays on disk: {exc}")


def control_port() -> str:
    """The /dev node of the virtio-serial port named `aenv.ctl` (no udev in the guest)."""
    base = "/sys/class/virtio-ports"
    for _ in range(500):
        if os.path.isdir(base):
            for port in os.listdir(base):
                try:
                    with open(f"{base}/{port}/name") as f:
                        if f.read().strip() == CTL_NAME:
                            return f"/dev/{port}"
                except OSError:
                    continue
        time.sleep(0.01)
    raise SystemExit("aenv-guest: no control port")


def _write_file(path: str, content: str) -> None:
    if os.path.islink(path):
        os.unlink(path)  # a template's symlink into /run would dangle: replace it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, content.encode())
    finally:
        os.close(fd)


def apply_identity(msg: dict[str, Any]) -> None:
    if msg.get("time"):
        time.clock_settime(time.CLOCK_REALTIME, float(msg["time"]))
    if msg.get("entropy"):
        data = bytes.fromhex(msg["entropy"])
        fd = os.open("/dev/random", os.O_WRONLY)
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(data) * 8, len(data)) + data)
            fcntl.ioctl(fd, RNDRESEEDCRNG)  # use it now, not at the next scheduled reseed
        finally:
            os.close(fd)
    if msg.get("hostname"):
        socket.sethostname(msg["hostname"])
        if os.path.isdir("/etc"):
            _write_file("/etc/hostname", msg["hostname"] + "\n")
    if msg.get("hosts") and os.path.isdir("/etc"):
        _write_file("/etc/hosts", msg["hosts"])
    if msg.get("resolv_conf") and os.path.isdir("/etc"):
        _write_file("/etc/resolv.conf", msg["resolv_conf"])


class Control:
    """The host's side channel. `config()` blocks for the boot configuration; afterwards a
    thread answers identity changes while envd runs in the main thread."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.buf = b""

    def _read(self) -> dict[str, Any] | None:
        idle = 0.01
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                # No host connected: read() returns at once (poll() would say POLLHUP), so
                # wait, backing off. The driver stays connected while it runs, so this only
                # spins briefly after a restore and at 1 Hz while the server is down: an
                # idle guest costs ~1% of a host core under TCG instead of ~3% at 20 Hz.
                time.sleep(idle)
                idle = min(idle * 2, 1.0)
                continue
            idle = 0.01
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg: dict[str, Any] = json.loads(line)
            return msg
        except ValueError:
            return None

    def _reply(self, msg: dict[str, Any], error: str | None = None) -> None:
        out = {"id": msg.get("id"), "ok": error is None}
        if error is not None:
            out["error"] = error
        os.write(self.fd, json.dumps(out).encode() + b"\n")

    def config(self) -> dict[str, Any]:
        while True:
            msg = self._read()
            if msg is None:
                continue
            if msg.get("op") != "config":
                self._reply(msg, "not configured yet")
                continue
            try:
                apply_identity(msg)
            except OSError as exc:
                self._reply(msg, str(exc))
                continue
            self._reply(msg)
            return msg

    def serve(self) -> None:
        while True:
            msg = self._read()
            if msg is None:
                continue
            try:
                if msg.get("op") == "identity":
                    apply_identity(msg)
                elif msg.get("op") != "ping":
                    raise ValueError(f"unknown op {msg.get('op')!r}")
            except (OSError, ValueError) as exc:
                self._reply(msg, str(exc))
                continue
            self._reply(msg)


def main() -> None:
    setup_mounts()
    bind_identity_files()
    _log(f"python up at {_uptime()}s")
    ctl = Control(control_port())
    cfg = ctl.config()
    _log(f"configured at {_uptime()}s")
    threading.Thread(target=ctl.serve, name="aenv-ctl", daemon=True).start()
    sys.path.insert(0, os.path.join(TOOLS, "py311", "app"))
    from aenv.envd.lean import block_ssl

    block_ssl()
    from aenv.envd.server import run
    from aenv.envd.settings import EnvdSettings

    # envd's log goes to a tmpfs file, not the serial console (slow under TCG).
    log = os.open(f"{RUN_DIR}/envd.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                  0o600)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update({"PATH": SANDBOX_PATH, "HOME": "/root"})
    os.chdir("/")
    envd = cfg["envd"]
    settings = EnvdSettings(port=int(envd["port"]), host="0.0.0.0",
                            access_token=envd.get("access_token"),
                            env_vars=dict(envd.get("env_vars") or {}),
                            default_user=envd.get("default_user") or "user",
                            default_workdir=envd.get("default_workdir"), is_init=True)
    run(settings)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # PID 1 exiting panics the kernel: say why first
        _log(f"fatal: {exc!r}")
        raise
