"""Keeping an envd-only process small.

Owns: `block_ssl()`. envd never speaks TLS, yet `import asyncio` loads `ssl`, and with
it OpenSSL: ~4 MiB RSS (~1.3 MiB of it private) in every envd. asyncio treats `ssl` as
optional, so an envd-only process — `python -m aenv.envd`, a fork server that only runs
envds — can refuse it. Call this before anything imports asyncio (i.e. before importing
`aenv.envd.server`). Never call it in a process that needs TLS: it makes `import ssl`
fail for the whole process.
"""

from __future__ import annotations

import sys


def block_ssl() -> bool:
    """Make `import ssl` fail from now on; False if it was already imported (too late)."""
    if "ssl" in sys.modules:
        return sys.modules["ssl"] is None
    sys.modules["ssl"] = None  # type: ignore[assignment]
    return True
