"""The sandbox seccomp profile (`aenv.runtime.container.seccomp`) compiled by libseccomp and
loaded by `linux.load_seccomp`, exactly as the zygote does, in a throwaway process: forked,
in new mount/uts/ipc/net/pid namespaces (so that even an unfiltered call with the harmless
arguments below could touch nothing of the host), as pid 1 of its pid namespace. The same
calls without the filter are the control: there the kernel answers with its own errnos."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aenv.config import load_config
from aenv.runtime.container import linux, seccomp

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_keep: list[Any] = []  # buffers whose addresses the calls below use


def _s(text: str) -> int:
    buf = ctypes.create_string_buffer(text.encode())
    _keep.append(buf)
    return ctypes.addressof(buf)


def _longs(*values: int) -> int:
    buf = (ctypes.c_long * len(values))(*values)
    _keep.append(buf)
    return ctypes.addressof(buf)


def _nr(name: str) -> int:
    return seccomp._number(name)


# Each refused syscall with arguments the kernel rejects (or that do nothing) even for root
# with every capability: the calls are harmless if the filter were missing.
REFUSED_CALLS: dict[str, tuple[int, ...]] = {
    "unshare": (0,), "setns": (-1, 0), "mount": (0, _s("/no/such"), 0, 0, 0),
    "umount2": (_s("/no/such"), 0), "pivot_root": (_s("/no/such"), _s("/no/such")),
    "fsopen": (0, 0), "fsconfig": (-1, 0, 0, 0, 0), "fsmount": (-1, 0, 0),
    "fspick": (-1, _s("/no/such"), 0), "move_mount": (-1, _s(""), -1, _s(""), 0),
    "open_tree": (-1, _s("/no/such"), 0), "mount_setattr": (-1, 0, 0, 0, 0),
    "keyctl": (0x7FFF,), "add_key": (0, 0, 0, 0, 0), "request_key": (0, 0, 0, 0),
    "bpf": (0x7FFF, 0, 0), "perf_event_open": (0, 0, -1, -1, 0xFFFFFFFF),
    "userfaultfd": (0xFFFF,), "io_uring_setup": (0, 0), "io_uring_enter": (-1, 0, 0, 0, 0, 0),
    "io_uring_register": (-1, 0, 0, 0), "kexec_load": (0, 1000, 0, 0x100),
    "kexec_file_load": (-1, -1, 0, 0, 0xFFFF), "reboot": (0, 0, 0, 0),
    "init_module": (0, 0, 0), "finit_module": (-1, 0, 0),
    "delete_module": (_s("aenv_no_such_module"), os.O_NONBLOCK),
    "open_by_handle_at": (-1, 0, 0), "kcmp": (1, 1, 99, 0, 0), "pidfd_getfd": (-1, 0, 0),
    "swapon": (_s("/no/such"), 0), "swapoff": (_s("/no/such"),), "acct": (_s("/no/such/x"),),
    "quotactl": (0, 0, 0, 0), "quotactl_fd": (-1, 0, 0, 0), "syslog": (-1, 0, 0),
    "vhangup": (), "iopl": (4,), "ioperm": (0x10000, 1, 1),
    "settimeofday": (_longs(0, -1), 0), "clock_settime": (1, _longs(0, 0)),
    "sethostname": (0, -1), "setdomainname": (0, -1), "fanotify_init": (0xFFFFFFFF, 0),
    "lookup_dcookie": (0, 0, 0), "nfsservctl": (0, 0, 0), "mbind": (0, 0, 0, 0, 0, 0),
    "set_mempolicy": (0xFFFF, 0, 0), "get_mempolicy": (0, 0, 0, 0, 0),
    "migrate_pages": (-1, 0, 0, 0), "move_pages": (-1, 0, 0, 0, 0, 0),
    "set_mempolicy_home_node": (0, 0, 0, 1), "modify_ldt": (0, 0, 0),
    "uselib": (_s("/no/such"),), "ustat": (0, 0), "sysfs": (0xFF, 0, 0), "_sysctl": (0,),
}
# Where the control (no filter, full root) must not say EPERM: the probe is discriminating.
KERNEL_SAYS_OTHERWISE = ("unshare", "setns", "mount", "umount2", "keyctl", "bpf",
                         "perf_event_open", "userfaultfd", "io_uring_setup", "finit_module",
                         "reboot", "sethostname")
CLONE_NEWUSER, CLONE_NEWNS, CLONE_FS = 0x10000000, 0x00020000, 0x00000200


def _call(name: str, args: tuple[int, ...]) -> int | str:
    res = _libc.syscall(ctypes.c_long(_nr(name)), *[ctypes.c_long(a) for a in args])
    if res < 0:
        return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    return int(res)


def _int80_getpid() -> int:
    """getpid through the 32-bit ABI (int 0x80, eax=20) from this 64-bit process."""
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20; int 0x80; ret
    func = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(code)))
    return int(func())


def _probes() -> dict[str, Any]:
    out: dict[str, Any] = {name: _call(name, args) for name, args in REFUSED_CALLS.items()}
    # clone's namespace flags: CLONE_FS with NEWNS/NEWUSER is EINVAL to the kernel itself.
    out["clone_newuser"] = _call("clone", (CLONE_NEWUSER | CLONE_FS, 0, 0, 0, 0))
    out["clone_newns"] = _call("clone", (CLONE_NEWNS | CLONE_FS, 0, 0, 0, 0))
    out["clone3"] = _call("clone3", (0, 0))
    out["personality_no_aslr"] = _call("personality", (0x0040000,))
    out["socket_vsock"] = _call("socket", (40, socket.SOCK_STREAM, 0))
    # Positive controls: ordinary work in the same process.
    out["personality_query"] = _call("personality", (0xFFFFFFFF,))
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(1))
    thread.start()
    thread.join()
    out["thread"] = results == [1]
    out["subprocess"] = subprocess.run(["true"], check=False).returncode
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s6, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as su:
        out["sockets"] = s6.fileno() > 0 and su.fileno() > 0
    with open("/proc/self/status") as f:
        out["seccomp"] = next(line.split()[1] for line in f if line.startswith("Seccomp:"))
    return out


def _in_throwaway(body: Callable[[], Any], program: bytes | None) -> tuple[Any, int]:
    """body()'s JSON result and the wait status of the process that ran it: forked into new
    namespaces, pid 1 there, with `program` loaded first (None: unfiltered)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            os.close(r)
            os.setsid()  # no controlling terminal: vhangup has nothing to hang up
            linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC
                          | linux.CLONE_NEWNET | linux.CLONE_NEWPID)
            linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
            inner = os.fork()
            if inner == 0:
                if program is not None:
                    linux.load_seccomp(program)
                os.write(w, json.dumps(body()).encode())
                os._exit(0)
            _, status = os.waitpid(inner, 0)
            os.write(w, b"\n" + str(status).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    data, _, status = b"".join(chunks).rpartition(b"\n")
    return (json.loads(data) if data else None), int(status)


@pytest.fixture(scope="module")
def program() -> bytes:
    return seccomp.compile_filter()


def test_profile_is_consistent_and_compiles(program: bytes) -> None:
    allowed = {name for rule in seccomp.PROFILE if rule.errno is None for name in rule.syscalls}
    assert not allowed & set(seccomp.REFUSED), allowed & set(seccomp.REFUSED)
    assert set(REFUSED_CALLS) == set(seccomp.REFUSED)  # every refusal is probed below
    assert len(program) % 8 == 0 and len(program) // 8 < 4096  # BPF_MAXINSNS
    assert seccomp.compile_filter() == program  # deterministic: one program per profile
    assert "KILL_PROCESS" in seccomp.export_pfc()  # the bad-architecture action


def test_refused_calls_get_eperm_and_the_kernel_would_have_answered(program: bytes) -> None:
    control, status = _in_throwaway(_probes, None)
    assert os.WIFEXITED(status) and control is not None, status
    assert control["seccomp"] == "0"
    seen, status = _in_throwaway(_probes, program)
    assert os.WIFEXITED(status) and seen is not None, status
    assert seen["seccomp"] == "2"
    wrong = {name: seen[name] for name in REFUSED_CALLS if seen[name] != "EPERM"}
    assert not wrong, wrong
    assert [name for name in KERNEL_SAYS_OTHERWISE if control[name] == "EPERM"] == []
    assert (control["clone_newuser"], seen["clone_newuser"]) == ("EINVAL", "EPERM")
    assert (control["clone_newns"], seen["clone_newns"]) == ("EINVAL", "EPERM")
    assert (control["clone3"], seen["clone3"]) == ("EINVAL", "ENOSYS")
    assert control["personality_no_aslr"] != "EPERM" and seen["personality_no_aslr"] == "EPERM"
    assert seen["socket_vsock"] == "EPERM"
    for out in (control, seen):
        assert isinstance(out["personality_query"], int)
        assert out["thread"] is True and out["subprocess"] == 0 and out["sockets"] is True


@pytest.mark.parametrize("abi", ["int80", "x32"])
def test_32_bit_abis_kill_the_process(program: bytes, abi: str) -> None:
    def call() -> int:
        if abi == "int80":
            return _int80_getpid()
        return int(_libc.syscall(ctypes.c_long(0x40000000 | 39)))  # x32 getpid

    control, status = _in_throwaway(call, None)
    assert os.WIFEXITED(status), status  # returned something (a pid, or -ENOSYS)
    assert control is not None
    seen, status = _in_throwaway(call, program)
    assert seen is None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS


def test_the_filter_is_on_by_default_and_can_be_turned_off(tmp_path: Path) -> None:
    assert load_config({"AENV_HOME": str(tmp_path)}).security.seccomp is True
    assert load_config({"AENV_HOME": str(tmp_path),
                        "AENV_SECURITY_SECCOMP": "0"}).security.seccomp is False
