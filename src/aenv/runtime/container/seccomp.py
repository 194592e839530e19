"""The seccomp profile of container sandboxes, as data, and its compilation to a BPF program.

Sandbox code is hostile; its way into the host kernel is the syscall interface. This profile
is an allowlist on the model of Docker's default (moby/profiles `seccomp/default.json`), for
x86_64 only, and stricter where noted: every syscall not allowed below answers EPERM (as
Docker), `clone3` answers ENOSYS (libc then falls back to `clone`, whose namespace flags the
filter can see), only the socket families gVisor supports are allowed (Docker refuses just
AF_ALG and AF_VSOCK), `modify_ldt` is refused, and the 32-bit ABIs (int 0x80, x32) kill
the process.

The filter is compiled once on the host by the container driver with libseccomp (through
`pyseccomp`), exported as a raw BPF program and sent to the fork-server in its `configure`
message; each sandbox child loads it (`linux.load_seccomp`) right before it becomes envd, so
envd and everything it starts run under it. CRIU dumps and restores the filter with the
process, so paused, resumed and forked sandboxes keep it.

Owns: the profile (`PROFILE`, `REFUSED`) and `compile_filter()`.
Must not touch: any process: nothing is loaded here (the host never filters itself). Not
part of the runtime bundle: the sandbox side has no libseccomp, only the bytes.
"""

from __future__ import annotations

import errno
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

# <linux/sched.h>: the namespace flags clone() must not carry (CLONE_NEWTIME is in the exit
# signal byte of clone(), so only clone3 and unshare could ask for it, and both are refused).
CLONE_NAMESPACES = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                    | 0x20000000 | 0x40000000)

# Socket families a sandbox may open: gVisor's set. Docker refuses only AF_ALG and AF_VSOCK;
# the rest (TIPC, RDS, CAN, X.25, AX.25, Bluetooth, ...) are rarely used protocol families
# whose module an unprivileged socket() autoloads, the way many of their CVEs were reached.
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET = 1, 2, 10, 16, 17
SOCKET_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET)

# x86_64 numbers of syscalls newer than the libseccomp we run with (Debian 12's 2.5.4),
# from the kernel's arch/x86/entry/syscalls/syscall_64.tbl. A name libseccomp knows must
# agree with this table (compile_filter checks).
NEWER_SYSCALLS = {
    "uretprobe": 335, "statmount": 457, "listmount": 458, "mseal": 462, "setxattrat": 463,
    "getxattrat": 464, "listxattrat": 465, "removexattrat": 466,
}


@dataclass(frozen=True)
class ArgIs:
    """One comparison on a syscall argument (the full 64 bits, so a value with high bits set
    that the kernel would truncate never matches an allow rule)."""

    index: int
    op: Literal["eq", "masked_eq"]
    value: int
    mask: int = 0  # masked_eq: (arg & mask) == value


@dataclass(frozen=True)
class Rule:
    """The syscalls that get `errno` (None: allowed) when every comparison holds."""

    syscalls: tuple[str, ...]
    errno: int | None = None
    when: tuple[ArgIs, ...] = ()


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Allowed outright: Docker's default list for x86_64 (without modify_ldt, and without
# epoll_ctl_old/epoll_wait_old, never implemented), grouped by what they do.
ALLOWED = _names("""
    read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 lseek
    open openat openat2 creat close close_range dup dup2 dup3 fcntl flock ioctl
    pipe pipe2 splice tee vmsplice sendfile copy_file_range readahead fadvise64
    fsync fdatasync sync syncfs sync_file_range fallocate truncate ftruncate
    stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2
    getdents getdents64 getcwd chdir fchdir mkdir mkdirat rmdir rename renameat renameat2
    link linkat symlink symlinkat unlink unlinkat readlink readlinkat mknod mknodat
    chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat umask
    utime utimes utimensat futimesat name_to_handle_at cachestat
    getxattr lgetxattr fgetxattr getxattrat setxattr lsetxattr fsetxattr setxattrat
    listxattr llistxattr flistxattr listxattrat removexattr lremovexattr fremovexattr
    removexattrat
    inotify_init inotify_init1 inotify_add_watch inotify_rm_watch fanotify_mark
    statmount listmount
    brk mmap munmap mremap mprotect madvise mincore msync mlock mlock2 mlockall munlock
    munlockall remap_file_pages membarrier memfd_create memfd_secret mseal
    pkey_alloc pkey_free pkey_mprotect map_shadow_stack arch_prctl
    execve execveat fork vfork exit exit_group wait4 waitid kill tkill tgkill
    pidfd_open pidfd_send_signal process_mrelease set_tid_address set_robust_list
    get_robust_list rseq restart_syscall prctl seccomp uretprobe
    get_thread_area set_thread_area
    getpid getppid gettid getpgid setpgid getpgrp getsid setsid
    getuid geteuid getgid getegid getresuid getresgid getgroups
    setuid setgid setreuid setregid setresuid setresgid setfsuid setfsgid setgroups
    capget capset getpriority setpriority getrlimit setrlimit prlimit64 getrusage
    sched_yield sched_getaffinity sched_setaffinity sched_getattr sched_setattr
    sched_getparam sched_setparam sched_getscheduler sched_setscheduler
    sched_get_priority_max sched_get_priority_min sched_rr_get_interval
    ioprio_get ioprio_set getcpu
    rt_sigaction rt_sigprocmask rt_sigpending rt_sigreturn rt_sigsuspend rt_sigtimedwait
    rt_sigqueueinfo rt_tgsigqueueinfo sigaltstack signalfd signalfd4 pause
    alarm getitimer setitimer nanosleep clock_nanosleep clock_gettime clock_getres
    clock_adjtime adjtimex gettimeofday time times sysinfo uname getrandom
    timer_create timer_delete timer_gettime timer_settime timer_getoverrun
    timerfd_create timerfd_gettime timerfd_settime eventfd eventfd2
    epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2
    poll ppoll select pselect6
    futex futex_waitv futex_wake futex_wait futex_requeue
    io_setup io_destroy io_submit io_cancel io_getevents io_pgetevents
    socketpair bind listen accept accept4 connect shutdown getsockname getpeername
    getsockopt setsockopt sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg
    mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
    msgget msgsnd msgrcv msgctl semget semop semtimedop semctl shmget shmat shmdt shmctl
    landlock_create_ruleset landlock_add_rule landlock_restrict_self
""") + (
    # Docker grants it with CAP_SYS_CHROOT, which sandboxes keep (zygote.KEEP_CAPS).
    "chroot",
    # Docker allows ptrace on kernels >= 4.8, where seccomp is checked again after a tracer
    # changed a syscall, so a tracee cannot be steered around the filter. Without
    # CAP_SYS_PTRACE it reaches only processes of the same user, inside the sandbox's own
    # pid namespace, and not envd (its capabilities exceed any command's). gdb, strace and
    # py-spy need it; an agent debugging a program is ordinary work.
    "ptrace", "process_vm_readv", "process_vm_writev",
)

PROFILE: tuple[Rule, ...] = (
    Rule(ALLOWED),
    # fork/vfork/threads, but no new namespaces (arg 0 of x86_64 clone is the flags).
    Rule(("clone",), when=(ArgIs(0, "masked_eq", 0, CLONE_NAMESPACES),)),
    # clone3's flags sit in a struct in memory, out of the filter's sight: ENOSYS makes glibc
    # (pthread_create, posix_spawn) fall back to clone.
    Rule(("clone3",), errno.ENOSYS),
    # Other socket families get EPERM, as Docker's AF_ALG and AF_VSOCK do.
    *(Rule(("socket",), when=(ArgIs(0, "eq", family),)) for family in SOCKET_FAMILIES),
    # Docker's personality values: PER_LINUX, PER_LINUX32, UNAME26 (and with PER_LINUX32),
    # and the query 0xffffffff. Not ADDR_NO_RANDOMIZE and friends.
    *(Rule(("personality",), when=(ArgIs(0, "eq", value),))
      for value in (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)),
)

# Notable syscalls the default action refuses (EPERM), and why: the allowlist must never
# grow to include one of these without a reason written here (tests check).
REFUSED: dict[str, str] = {
    **dict.fromkeys(("unshare", "setns"), "new or other namespaces: a user namespace hands "
                    "out CAP_SYS_ADMIN over fresh mount and network namespaces, the largest "
                    "kernel attack surface an unprivileged user can reach"),
    **dict.fromkeys(("mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount",
                     "fspick", "move_mount", "open_tree", "mount_setattr"),
                    "mounts: the sandbox's mount tree is made before the filter and stays"),
    **dict.fromkeys(("keyctl", "add_key", "request_key"),
                    "kernel keyrings are not namespaced"),
    "bpf": "eBPF verifier and JIT",
    "perf_event_open": "host performance counters, a long CVE history",
    "userfaultfd": "lets user code stall kernel paths at will (an exploit primitive)",
    **dict.fromkeys(("io_uring_setup", "io_uring_enter", "io_uring_register"),
                    "io_uring performs I/O outside the syscall filter's sight; a large "
                    "source of kernel CVEs (Docker refuses it since 2023)"),
    **dict.fromkeys(("kexec_load", "kexec_file_load", "reboot"), "the host's kernel"),
    **dict.fromkeys(("init_module", "finit_module", "delete_module"), "kernel modules"),
    "open_by_handle_at": "opens any file of a filesystem by handle, outside the root",
    **dict.fromkeys(("kcmp", "pidfd_getfd"), "Docker grants them with CAP_SYS_PTRACE only"),
    **dict.fromkeys(("swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
                     "vhangup", "iopl", "ioperm", "settimeofday", "clock_settime",
                     "sethostname", "setdomainname", "fanotify_init", "lookup_dcookie",
                     "nfsservctl"), "host administration (Docker: capabilities we drop)"),
    **dict.fromkeys(("mbind", "set_mempolicy", "get_mempolicy", "migrate_pages",
                     "move_pages", "set_mempolicy_home_node"),
                    "NUMA policy (Docker: CAP_SYS_NICE only)"),
    "modify_ldt": "16-bit segments (Wine, DOS emulators); stricter than Docker, which "
                  "allows it: a past source of kernel bugs with no use in a sandbox",
    **dict.fromkeys(("uselib", "ustat", "sysfs", "_sysctl"), "obsolete interfaces"),
}

_BPF_INSN = 8  # sizeof(struct sock_filter)


def _number(name: str) -> int:
    import pyseccomp  # type: ignore[import-untyped]  # host only, see the module docstring

    known = int(pyseccomp.resolve_syscall(pyseccomp.Arch.X86_64, name))
    table = NEWER_SYSCALLS.get(name)
    if known >= 0:
        if table is not None and table != known:
            raise ValueError(f"seccomp profile: {name} is {known} to libseccomp, not {table}")
        return known
    if table is None:
        raise ValueError(f"seccomp profile: no x86_64 syscall {name!r}")
    return table


def _build(profile: tuple[Rule, ...]) -> Any:
    """The profile as a libseccomp filter context (pyseccomp.SyscallFilter)."""
    import pyseccomp

    ops = {"eq": pyseccomp.EQ, "masked_eq": pyseccomp.MASKED_EQ}
    flt = pyseccomp.SyscallFilter(pyseccomp.ERRNO(errno.EPERM))
    # Only x86_64 is added (libseccomp's native default): int 0x80 and x32 calls end the
    # process (Docker allows both ABIs; their compat code paths are a bug class of their own).
    flt.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.KILL_PROCESS)
    # A binary tree over syscall numbers: a few comparisons per syscall instead of a linear
    # walk through ~330 allowed ones.
    flt.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)
    for rule in profile:
        action = pyseccomp.ALLOW if rule.errno is None else pyseccomp.ERRNO(rule.errno)
        # libseccomp's masked_eq takes (mask, value); the others (value, unused).
        args = [pyseccomp.Arg(cmp.index, ops[cmp.op],
                              cmp.mask if cmp.op == "masked_eq" else cmp.value,
                              cmp.value if cmp.op == "masked_eq" else 0)
                for cmp in rule.when]
        for name in rule.syscalls:
            flt.add_rule(action, _number(name), *args)
    return flt


def compile_filter(profile: tuple[Rule, ...] = PROFILE) -> bytes:
    """The profile as a BPF program (struct sock_filter[]) for `linux.load_seccomp`.
    A few milliseconds of libseccomp work: the driver does it once per fork-server."""
    with tempfile.TemporaryFile() as out:
        _build(profile).export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % _BPF_INSN:
        raise ValueError(f"seccomp: libseccomp exported {len(program)} bytes")
    return program


def export_pfc(profile: tuple[Rule, ...] = PROFILE) -> str:
    """libseccomp's readable pseudo-code of the filter (for docs and debugging)."""
    with tempfile.TemporaryFile("w+") as out:
        _build(profile).export_pfc(out)
        out.seek(0)
        return out.read()
