"""Paths under AENV_HOME, in one place so no other module builds them by hand, and who may
read them: the home is the server's alone (0700). Everything under it is reachable only by
root, whatever its own mode: the database and its WAL (every sandbox's envd token), secrets,
checkpoint images (process memory), the writable layers (a sandbox's setuid files and device
nodes). A home that someone else could write (or replace) is refused at start.

Owns: the modes of the home and of the directories and files named here. Must not touch: what
is inside layers and workspaces (their modes are the sandboxes' own).
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def check_home_path(home: Path) -> None:
    """Refuse a home another user could tamper with: the home itself (if it exists) and each
    existing directory above it must be owned by root (or us) and not be writable by group or
    others, except that an ancestor may be a sticky world-writable directory such as /tmp
    (nobody else can rename or remove our entry in it). Otherwise another user could swap in
    their own database, layers or secrets, or read ours before we restrict them."""
    me = os.geteuid()
    path = home.absolute()
    for current in (path, *path.parents):
        try:
            st = current.lstat()
        except FileNotFoundError:
            continue  # created later, by us, with our modes
        if stat.S_ISLNK(st.st_mode):
            st = current.stat()  # a symlink's target must pass the same checks
        if st.st_uid not in (0, me):
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"AENV_HOME {home}: {current} is owned by uid {st.st_uid}; it must "
                            "be owned by root")
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky = st.st_mode & stat.S_ISVTX
        if writable and (current == path or not sticky):
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"AENV_HOME {home}: {current} is writable by other users (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}); run `chmod go-w {current}`")


@dataclass(frozen=True)
class Layout:
    home: Path

    @property
    def database(self) -> Path:
        return self.home / "aenv.sqlite3"

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    @property
    def api_key_file(self) -> Path:
        return self.secrets_dir / "api_key"

    @property
    def layers_dir(self) -> Path:
        return self.home / "layers"

    def layer(self, layer_id: str) -> Path:
        return self.layers_dir / layer_id

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"

    def workspace(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    @property
    def snapshots_dir(self) -> Path:
        return self.home / "snapshots"

    def snapshot(self, snapshot_id: str) -> Path:
        return self.snapshots_dir / snapshot_id

    @property
    def volumes_dir(self) -> Path:
        """E2B volumes (orchestrator/volumes.py): their records and files."""
        return self.home / "volumes"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    def ensure_home(self) -> None:
        """The home itself, private. Raises AenvError(UNAVAILABLE) on a home others can
        write (check_home_path)."""
        check_home_path(self.home)
        self.home.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        # Also an existing home of an older version (0755): nothing below it is for others.
        self.home.chmod(PRIVATE_DIR)

    def ensure(self) -> None:
        """The home and its directories, private (after storage/volume.attach_storage() where
        the server uses a managed volume: some of them are symlinks into it)."""
        self.ensure_home()
        for d in (self.layers_dir, self.sandboxes_dir, self.run_dir, self.cache_dir,
                  self.snapshots_dir, self.secrets_dir):
            d.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        for d in (self.cache_dir, self.snapshots_dir, self.secrets_dir):
            d.chmod(PRIVATE_DIR)  # checkpoint images, repository caches, the API key
        for f in (self.database, self.database.with_name(self.database.name + "-wal"),
                  self.database.with_name(self.database.name + "-shm"), self.api_key_file):
            if f.exists():
                f.chmod(PRIVATE_FILE)

    def api_key(self) -> str:
        """The node's API key, generated on first use and kept in secrets/api_key (0600)."""
        path = self.api_key_file
        if path.exists():
            key = path.read_text().strip()
            if key:
                return key
        self.ensure()
        key = "aenv_" + secrets.token_hex(20)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return key
