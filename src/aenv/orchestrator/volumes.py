"""Volumes (E2B's `/volumes`): named directories that sandboxes mount read-write, kept outside
every sandbox's writable layer, so that several sandboxes (fork children too) share one, a
pause copies none of it and a kill leaves it.

Layout: `$AENV_HOME/volumes/<volume id>/` (0700) holds `volume.json` (the record: id, name,
the content API token, size) and `data/`, the directory sandboxes mount and the content API
reads and writes. Where volumes live on btrfs (the managed storage volume, or a btrfs home),
`data/` is a subvolume whose quota group limits it to the volume's size (btrfs simple quotas:
writes past it fail with EDQUOT, in sandboxes and through the content API alike); elsewhere
the size is advisory and `quota` is false.

Owns: `$AENV_HOME/volumes/`. Must not touch: sandboxes (the manager asks `users` before a
delete), anything outside a volume's directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import string
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from aenv.errors import AenvError, ErrorCode, invalid, not_found
from aenv.runtime.container import linux

log = logging.getLogger(__name__)

RECORD = "volume.json"
DATA = "data"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ID_RE = re.compile(r"^vol-[a-z0-9]{16}$")
# The sandbox's default user (`user`, uid 1000 in the base template) owns a new volume's root.
DEFAULT_OWNER = 1000


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    name: str
    token: str  # the volume content API's bearer token
    size_mb: int
    created_at: str
    quota: bool  # whether size_mb is enforced (btrfs quota group)


def _new_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "vol-" + "".join(secrets.choice(alphabet) for _ in range(16))


class VolumeManager:
    """Volume records and directories. `users(volume_id)` names the sandboxes and snapshots
    that mount the volume (a delete is refused while there are any)."""

    def __init__(self, root: Path, default_size_mb: int, max_volumes: int,
                 users: Callable[[str], list[str]] | None = None) -> None:
        self.root = root
        self.default_size_mb = default_size_mb
        self.max_volumes = max_volumes
        self.users = users or (lambda _volume_id: [])
        self._records: dict[str, VolumeRecord] = {}
        self._quota: bool | None = None

    # -- start ---------------------------------------------------------------------------
    def load(self) -> None:
        """Read the records on disk (blocking, at server start)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)
        for entry in self.root.iterdir():
            path = entry / RECORD
            if not _ID_RE.match(entry.name) or not path.is_file():
                continue
            try:
                rec = VolumeRecord(**json.loads(path.read_text()))
            except (ValueError, TypeError) as exc:
                log.error("volume %s: unreadable record (%s); left alone", entry.name, exc)
                continue
            self._records[rec.volume_id] = rec

    def _quotas_on(self) -> bool:
        if self._quota is None:
            self._quota = False
            if linux.on_btrfs(str(self.root)):
                try:
                    linux.btrfs_enable_simple_quota(str(self.root))
                    self._quota = True
                except OSError as exc:
                    log.warning("btrfs simple quotas unavailable (%s): volume sizes are not "
                                "enforced", exc)
            else:
                log.warning("%s is not on btrfs: volume sizes are not enforced", self.root)
        return self._quota

    # -- records -------------------------------------------------------------------------
    def list(self) -> list[VolumeRecord]:
        return sorted(self._records.values(), key=lambda r: (r.created_at, r.volume_id))

    def get(self, volume_id: str) -> VolumeRecord:
        rec = self._records.get(volume_id)
        if rec is None:
            raise not_found(f"volume {volume_id} not found")
        return rec

    def by_name(self, name: str) -> VolumeRecord:
        for rec in self._records.values():
            if rec.name == name:
                return rec
        raise not_found(f"volume '{name}' not found")

    def data_dir(self, volume_id: str) -> Path:
        """The host directory of the volume's files (resolved: the home's storage
        directories may be symlinks into the managed volume)."""
        return (self.root / volume_id / DATA).resolve()

    def authorize(self, volume_id: str, token: str) -> VolumeRecord:
        """The volume whose content API `token` is; UNAUTHENTICATED otherwise."""
        rec = self._records.get(volume_id)
        if rec is None or not secrets.compare_digest(rec.token.encode(), token.encode()):
            # Unknown ids answer the same: a token check must not reveal which ids exist.
            raise AenvError(ErrorCode.UNAUTHENTICATED,
                            "invalid or missing volume token: send Authorization: Bearer "
                            "<token> (from POST /volumes or GET /volumes/{id})")
        return rec

    def create(self, name: str, size_mb: int | None = None) -> VolumeRecord:
        """A new, empty volume (blocking: a subvolume, ~1 ms)."""
        if not _NAME_RE.match(name):
            raise invalid(f"volume name {name!r}: 1-128 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
        if any(r.name == name for r in self._records.values()):
            raise AenvError(ErrorCode.CONFLICT, f"a volume named '{name}' exists")
        if len(self._records) >= self.max_volumes:
            raise AenvError(ErrorCode.RESOURCE_EXHAUSTED,
                            f"node is at its limit of {self.max_volumes} volumes")
        size = self.default_size_mb if size_mb is None else size_mb
        if not 1 <= size <= 16 * 2**20:
            raise invalid("sizeMB must be between 1 and 16777216 (16 TiB)")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        volume_id = _new_id()
        home = self.root / volume_id
        home.mkdir(mode=0o700)
        try:
            quota = self._quotas_on()
            data = home / DATA
            if quota:
                linux.subvolume_create(str(data))
                linux.subvolume_limit(str(data), size * 2**20)
            else:
                data.mkdir()
            os.chown(data, DEFAULT_OWNER, DEFAULT_OWNER)
            data.chmod(0o755)
            rec = VolumeRecord(volume_id=volume_id, name=name, token=secrets.token_urlsafe(32),
                               size_mb=size, created_at=datetime.now(UTC).isoformat(),
                               quota=quota)
            tmp = home / (RECORD + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(rec), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, home / RECORD)
        except BaseException:
            self._remove_dir(home)
            raise
        self._records[volume_id] = rec
        return rec

    def delete(self, volume_id: str) -> None:
        """Remove a volume and its files (blocking). CONFLICT while anything mounts it."""
        rec = self.get(volume_id)
        users = self.users(volume_id)
        if users:
            raise AenvError(ErrorCode.CONFLICT,
                            f"volume {rec.name} is mounted by {', '.join(sorted(users)[:10])}: "
                            "kill those sandboxes (and delete those snapshots) first")
        home = self.root / volume_id
        # The record goes first: a crash half-way leaves no volume that looks usable.
        with contextlib.suppress(FileNotFoundError):
            (home / RECORD).unlink()
        self._records.pop(volume_id, None)
        self._remove_dir(home)

    @staticmethod
    def _remove_dir(home: Path) -> None:
        data = home / DATA
        if data.exists() and linux.is_subvolume(str(data)):
            try:
                linux.subvolume_delete(str(data))
            except OSError as exc:
                log.warning("volume %s: subvolume delete failed (%s); removing its files",
                            home.name, exc)
        shutil.rmtree(home, ignore_errors=True)
