"""File operations with a sandbox user's credentials: the kernel checks them, not envd.

Owns: switching the *calling thread's* filesystem uid, gid and supplementary groups to a
user's for one synchronous block of file operations (`FsCredentials.as_user`), and back;
and stepping a long walk (a generator) through such blocks (`FsCredentials.steps`).
Inside a block every path lookup, open, mkdir, rename, unlink, scandir and inotify watch
is checked by the kernel exactly as for a process of that user: search permission on each
directory, symlinks (fs.protected_symlinks included) and `..` resolved as that user,
sticky directories, and what is created belongs to the user. Must not touch: the
process-wide credentials (real/effective uid, capabilities) — commands envd forks, and
everything else envd does, stay root.

Why the fs ids and not seteuid: Linux keeps credentials per thread; setfsuid/setfsgid
change only the fs ids, and when the fs uid leaves 0 the kernel drops CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN, CAP_FSETID, CAP_MKNOD (...) from the thread's
effective set, restoring them when it returns to 0 (capabilities(7)). Supplementary groups
are set with the raw setgroups syscall: glibc's setgroups() (and Python's os.setgroups())
signal every thread of the process to change theirs.

Why on envd's own event-loop thread rather than worker threads: envd is thread-free on
purpose (it is PID 1 and forks commands with os.fork(); a CRIU image of one thread is
simpler) and a switch costs a few syscalls (~2 µs), less than a hop to a thread. The price
is one rule: nothing inside a block may await, or another request's coroutine would run with
this user's ids — hence the synchronous context manager and `steps()` for walks that must
give the loop a turn. Fails closed: if a switch cannot be verified the operation is refused.

`as_envd()` lends envd's own credentials back inside a block, for envd's private state only
(the metadata sidecar directory, keyed by an inode the user has already reached).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from aenv.envd.errors import RpcError
from aenv.envd.users import User

# (setgroups, setfsuid, setfsgid) syscall numbers, per architecture envd runs on.
_SYSCALLS = {"x86_64": (116, 122, 123), "aarch64": (159, 151, 152)}
_INVALID_ID = 0xFFFFFFFF  # (uid_t)-1: setfs[ug]id() then changes nothing and returns the current id
STEP_YIELD_EVERY = 256  # entries a walk handles between two turns of the event loop

@functools.cache
def _lib() -> Any:
    """libc through ctypes, loaded on first use (an envd serving only root never needs it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def preload() -> None:
    _lib()


def _refused(what: str) -> RpcError:
    return RpcError("internal", f"cannot act as the requested user: {what}")


class _ThreadIds:
    """The raw per-thread syscalls; every change is verified, never assumed."""

    def __init__(self) -> None:
        numbers = _SYSCALLS.get(os.uname().machine)
        if numbers is None:
            raise _refused(f"unsupported architecture {os.uname().machine}")
        self._setgroups, self._setfsuid, self._setfsgid = numbers

    def set_groups(self, groups: tuple[int, ...]) -> None:
        import ctypes

        array = (ctypes.c_uint32 * max(len(groups), 1))(*groups)
        libc = _lib()
        if libc.syscall(ctypes.c_long(self._setgroups), ctypes.c_long(len(groups)), array) != 0:
            raise _refused(f"setgroups: {os.strerror(ctypes.get_errno())}")

    def set_fsgid(self, gid: int) -> None:
        self._set(self._setfsgid, gid, "setfsgid")

    def set_fsuid(self, uid: int) -> None:
        self._set(self._setfsuid, uid, "setfsuid")

    def _set(self, number: int, value: int, name: str) -> None:
        import ctypes

        libc = _lib()
        libc.syscall(ctypes.c_long(number), ctypes.c_long(value))
        # Both calls return the id in force before them: the second one reports the first's effect.
        current = libc.syscall(ctypes.c_long(number), ctypes.c_long(_INVALID_ID))
        if current != value:
            raise _refused(f"{name}({value}) left it at {current}")


class FsCredentials:
    """Switches envd's thread to a user's filesystem credentials around a synchronous block."""

    def __init__(self) -> None:
        # Only a privileged envd can act as someone else; an unprivileged one (tests,
        # `--not-init` runs as a user) acts as itself, the only user it can be.
        self._privileged = os.geteuid() == 0
        self._ids: _ThreadIds | None = None
        self._active: User | None = None
        self._own_groups: tuple[int, ...] = ()

    def switches_for(self, user: User) -> bool:
        """Whether operations for `user` run with other ids than envd's own (root needs none:
        envd is root, and the kernel's answer for root is yes)."""
        return self._privileged and user.uid != 0

    @contextlib.contextmanager
    def as_user(self, user: User) -> Iterator[None]:
        """Run the block's file operations as `user`. The block must not await."""
        if not self.switches_for(user):
            yield
            return
        if self._active is not None:
            raise RuntimeError("FsCredentials.as_user blocks do not nest")
        ids = self._ids
        if ids is None:
            ids = self._ids = _ThreadIds()
        self._own_groups = tuple(os.getgroups())
        try:
            # Groups and gid first: changing them needs CAP_SETGID, which the fs uid does not
            # affect, but doing the uid last keeps every step verifiable.
            ids.set_groups(user.groups)
            ids.set_fsgid(user.gid)
            ids.set_fsuid(user.uid)
            self._active = user
            yield
        finally:
            self._active = None
            self._restore(ids)

    def _restore(self, ids: _ThreadIds) -> None:
        ids.set_fsuid(os.geteuid())  # first: gives the thread its file capabilities back
        ids.set_fsgid(os.getegid())
        ids.set_groups(self._own_groups)

    @contextlib.contextmanager
    def as_envd(self) -> Iterator[None]:
        """Inside an `as_user` block: envd's own credentials for envd's private state."""
        user, ids = self._active, self._ids
        if user is None or ids is None:
            yield
            return
        self._active = None
        self._restore(ids)
        try:
            yield
        finally:
            ids.set_groups(user.groups)
            ids.set_fsgid(user.gid)
            ids.set_fsuid(user.uid)
            self._active = user

    async def steps(self, user: User, work: Iterator[None]) -> None:
        """Drive `work`, a generator that yields now and then (every `STEP_YIELD_EVERY`
        entries), as `user`: each step runs in its own block, and the event loop gets a turn
        between steps, never inside one."""
        done = object()
        while True:
            with self.as_user(user):
                step = next(work, done)
            if step is done:
                return
            await asyncio.sleep(0)
