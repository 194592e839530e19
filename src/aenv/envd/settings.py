"""The contract between a runtime driver and the envd it starts inside a sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field

# The version reported to SDKs in `envdVersion`. 0.6.13 turns on every SDK feature gate
# (octet-stream/gzip uploads, file metadata, recursive watch, close_stdin, ...), and we
# implement every one of them.
ENVD_VERSION = "0.6.13"


@dataclass
class EnvdSettings:
    port: int = 49983
    host: str = "0.0.0.0"
    access_token: str | None = None  # None: no token checks (sandbox created without one)
    env_vars: dict[str, str] = field(default_factory=dict)  # sandbox-wide process env
    default_user: str = "user"
    default_workdir: str | None = None  # None: the user's home
    is_init: bool = True  # PID 1 of its pid namespace: also reap orphaned processes
    # Where file metadata goes on filesystems without user xattrs (None: not persisted there).
    metadata_dir: str | None = "/run/aenv/envd-metadata"
