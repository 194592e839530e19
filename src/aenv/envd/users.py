"""Users and groups of the sandbox userland, read from /etc/passwd and /etc/group.

Owns: looking a user up by name (uid, gid, home, shell, supplementary groups) and
uid/gid → name for file ownership. The files are parsed directly rather than through
`pwd`/`grp`: those go through the C library's NSS, which in an arbitrary template userland
may try to load modules that do not match envd's bundled runtime. Both files are re-read
when their mtime changes, so users added while the sandbox runs (`useradd`) are seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aenv.envd.errors import RpcError


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str
    groups: tuple[int, ...]  # primary gid first, then supplementary groups


# Every userland has a root, even one whose /etc/passwd forgot it.
_ROOT = ("root", 0, 0, "/root", "/bin/sh")


class UserDb:
    def __init__(self, passwd: str = "/etc/passwd", group: str = "/etc/group") -> None:
        self._passwd_path = passwd
        self._group_path = group
        self._stamp: tuple[float, float] | None = None
        self._users: dict[str, tuple[str, int, int, str, str]] = {}
        self._uid_names: dict[int, str] = {}
        self._gid_names: dict[int, str] = {}
        self._members: dict[str, list[int]] = {}

    def _mtime(self, path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return -1.0

    def _refresh(self) -> None:
        stamp = (self._mtime(self._passwd_path), self._mtime(self._group_path))
        if stamp == self._stamp:
            return
        users: dict[str, tuple[str, int, int, str, str]] = {}
        uid_names: dict[int, str] = {}
        for fields in _read_colon_file(self._passwd_path, 7):
            try:
                uid, gid = int(fields[2]), int(fields[3])
            except ValueError:
                continue
            users.setdefault(fields[0], (fields[0], uid, gid, fields[5] or "/", fields[6]))
            uid_names.setdefault(uid, fields[0])
        gid_names: dict[int, str] = {}
        members: dict[str, list[int]] = {}
        for fields in _read_colon_file(self._group_path, 4):
            try:
                gid = int(fields[2])
            except ValueError:
                continue
            gid_names.setdefault(gid, fields[0])
            for member in fields[3].split(","):
                member = member.strip()
                if member:
                    members.setdefault(member, []).append(gid)
        if "root" not in users:
            users["root"] = _ROOT
            uid_names.setdefault(0, "root")
        gid_names.setdefault(0, "root")
        self._users, self._uid_names, self._gid_names, self._members = (
            users,
            uid_names,
            gid_names,
            members,
        )
        self._stamp = stamp

    def lookup(self, name: str) -> User | None:
        self._refresh()
        entry = self._users.get(name)
        if entry is None:
            return None
        name, uid, gid, home, shell = entry
        groups = [gid]
        for extra in self._members.get(name, ()):
            if extra not in groups:
                groups.append(extra)
        return User(name, uid, gid, home, shell or "/bin/sh", tuple(groups))

    def resolve(self, name: str) -> User:
        """The user or an `unauthenticated` error, as envd answers an unknown user."""
        user = self.lookup(name)
        if user is None:
            raise RpcError("unauthenticated", f"invalid username: '{name}'")
        return user

    def user_name(self, uid: int) -> str:
        self._refresh()
        return self._uid_names.get(uid, str(uid))

    def group_name(self, gid: int) -> str:
        self._refresh()
        return self._gid_names.get(gid, str(gid))


def _read_colon_file(path: str, width: int) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        if not line or line.startswith(("#", "+", "-")):
            continue
        fields = line.split(":")
        if len(fields) < width:
            fields += [""] * (width - len(fields))
        rows.append(fields)
    return rows
