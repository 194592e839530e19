"""Errors specific to the snapshot repository.

Owns: the corruption error (a blob whose bytes do not hash to its name). Must not touch: the
error-code enum or HTTP mapping (those live in `aenv.errors` / `aenv.api.errors`).
"""

from __future__ import annotations

from aenv.errors import AenvError, ErrorCode


class BlobCorrupted(AenvError):
    """A stored blob or manifest failed verification (code DATA_LOSS). Never carries the bad
    bytes onward."""

    def __init__(self, repository: str, what: str, detail: str) -> None:
        super().__init__(
            ErrorCode.DATA_LOSS,
            f"snapshot repository {repository}: {what} is corrupt ({detail}); "
            "refusing to use it",
        )
        self.repository = repository
        self.what = what
