"""Attacks on the kernel's syscall interface, run *inside* a sandbox by python3 (uploaded by
test_seccomp.py; standard library only). Prints one JSON object: for each attempt, 0 or a
number (it worked: a result, an fd) or the errno name it failed with.

Each attempt is the real thing where that is harmless inside a sandbox (a user namespace, a
keyring, a perf counter, an io_uring), or otherwise arguments the kernel itself would refuse
with an errno other than EPERM (so that EPERM can only have come from a seccomp filter)."""

import ctypes
import errno
import json
import os
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWUSER, SIGCHLD = 0x00020000, 0x10000000, 17
NR = {"clone": 56, "unshare": 272, "personality": 135, "mount": 165, "keyctl": 250,
      "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
      "userfaultfd": 323, "io_uring_setup": 425, "clone3": 435, "setns": 308,
      "pivot_root": 155, "open_by_handle_at": 304, "fsopen": 430, "kcmp": 312}


def raw(name, *args):
    """The syscall through libc's syscall(): its result, or the errno name."""
    res = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) for a in args])
    if res < 0:
        return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    return int(res)


def ptr(buf):
    return ctypes.cast(buf, ctypes.c_void_p).value


def user_namespace_then_mount():
    """unshare -Urm, by hand: a new user and mount namespace, our uid mapped to root, then a
    tmpfs mounted (root of a user namespace may mount tmpfs)."""
    uid, gid = os.getuid(), os.getgid()
    res = raw("unshare", CLONE_NEWUSER | CLONE_NEWNS)
    if res != 0:
        return res
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")
    os.makedirs("/tmp/probe-mnt", exist_ok=True)
    if libc.mount(b"none", b"/tmp/probe-mnt", b"tmpfs", 0, None) != 0:
        return "mounted-failed:" + errno.errorcode[ctypes.get_errno()]
    return "mounted"


def clone_newuser():
    """clone(CLONE_NEWUSER) straight, not through unshare: the child exits at once."""
    res = raw("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if res == 0:
        os._exit(0)
    if isinstance(res, int):
        os.waitpid(res, 0)
        return "cloned"
    return res


def perf_counter():
    """A task-clock software counter on ourselves, user space only (perf_event_paranoid 2
    allows it to anyone)."""
    attr = bytearray(128)
    struct.pack_into("IIQ", attr, 0, 1, 128, 1)  # PERF_TYPE_SOFTWARE, size, TASK_CLOCK
    struct.pack_into("Q", attr, 40, (1 << 5) | (1 << 6))  # exclude_kernel | exclude_hv
    buf = (ctypes.c_char * 128).from_buffer(attr)
    return raw("perf_event_open", ptr(buf), 0, -1, -1, 0)


def io_uring():
    params = (ctypes.c_char * 120)()
    return raw("io_uring_setup", 4, ptr(params))


def in_child(attempt):
    """Run `attempt` in a forked child (a successful unshare would change this process)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            result = attempt()
        except OSError as exc:
            result = "raised:" + errno.errorcode.get(exc.errno, str(exc.errno))
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    data = os.read(r, 4096)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data) if data else "child died"


def main():
    out = {}
    out["unshare_user_mount"] = in_child(user_namespace_then_mount)
    out["unshare_user"] = in_child(lambda: raw("unshare", CLONE_NEWUSER))
    out["clone_newuser"] = clone_newuser()
    out["setns"] = raw("setns", os.open("/proc/self/ns/user", os.O_RDONLY), 0)
    out["mount_missing_target"] = raw("mount", ptr(ctypes.c_char_p(b"none")),
                                      ptr(ctypes.c_char_p(b"/no/such/dir")),
                                      ptr(ctypes.c_char_p(b"tmpfs")), 0, 0)  # kernel: ENOENT
    out["pivot_root_missing"] = raw("pivot_root", ptr(ctypes.c_char_p(b"/no/such")),
                                    ptr(ctypes.c_char_p(b"/no/such")))  # kernel: ENOENT
    out["fsopen_bad_flags"] = raw("fsopen", ptr(ctypes.c_char_p(b"tmpfs")), 0xFF)  # EINVAL
    # A session keyring of our own (keyrings are not namespaced: shared with the host).
    out["keyctl_join_session"] = raw("keyctl", 1, 0)  # KEYCTL_JOIN_SESSION_KEYRING
    out["add_key"] = raw("add_key", ptr(ctypes.c_char_p(b"user")),
                         ptr(ctypes.c_char_p(b"aenv-probe")), ptr(ctypes.c_char_p(b"x")), 1,
                         -2)  # KEY_SPEC_PROCESS_KEYRING
    out["request_key"] = raw("request_key", ptr(ctypes.c_char_p(b"user")),
                             ptr(ctypes.c_char_p(b"aenv-none")), 0, 0)  # kernel: ENOKEY
    out["bpf_bad_command"] = raw("bpf", 0x7FFF, 0, 0)  # kernel: EINVAL
    out["perf_event_open"] = perf_counter()
    out["userfaultfd_user_mode"] = raw("userfaultfd", 1 | os.O_CLOEXEC)  # UFFD_USER_MODE_ONLY
    out["io_uring_setup"] = io_uring()
    out["open_by_handle_at"] = raw("open_by_handle_at", -1, 0, 0)  # kernel: EBADF (or EPERM)
    out["kcmp_bad_type"] = raw("kcmp", os.getpid(), os.getpid(), 99, 0, 0)  # kernel: EINVAL
    out["clone3_null"] = raw("clone3", 0, 0)  # kernel: EINVAL; filter: ENOSYS
    out["personality_no_aslr"] = raw("personality", 0x0040000)  # ADDR_NO_RANDOMIZE
    # Positive controls: the same interfaces as ordinary programs use them.
    out["personality_query"] = raw("personality", 0xFFFFFFFF)
    for name, family in (("alg", 38), ("vsock", 40), ("tipc", 30)):
        try:
            socket.socket(family, socket.SOCK_SEQPACKET if name != "alg" else 5).close()
            out[f"socket_{name}"] = 0
        except OSError as exc:
            out[f"socket_{name}"] = errno.errorcode.get(exc.errno, str(exc.errno))
    for name, family, kind in (("unix", socket.AF_UNIX, socket.SOCK_STREAM),
                               ("inet", socket.AF_INET, socket.SOCK_STREAM),
                               ("inet6", socket.AF_INET6, socket.SOCK_DGRAM),
                               ("netlink", socket.AF_NETLINK, socket.SOCK_RAW)):
        socket.socket(family, kind).close()
        out[f"socket_{name}"] = 0
    with open("/proc/self/status") as f:
        out["status"] = dict(line.split(":\t", 1) for line in f.read().splitlines()
                             if line.startswith("Seccomp"))
    json.dump(out, sys.stdout)


main()
