"""Paths under AENV_HOME, in one place so no other module builds them by hand."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path


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
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    def ensure(self) -> None:
        for d in (self.home, self.layers_dir, self.sandboxes_dir, self.run_dir, self.cache_dir,
                  self.snapshots_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

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
