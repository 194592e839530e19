"""Identifiers and secrets handed out by the orchestrator."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    """20 characters of [a-z0-9]: safe in host names (`<port>-<id>.<domain>`), like E2B's."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


def new_client_id() -> str:
    return secrets.token_hex(4)


def new_access_token() -> str:
    return "envd_" + secrets.token_urlsafe(24)
