"""nftables commands run inside the server process through libnftables, the library the `nft`
program is itself a thin front end to (Debian's libnftables1, a dependency of `nftables`).

A per-slot set update through one reused context costs ~0.1 ms; an `nft` process costs ~4 ms
(measured on this 2-core host), and slots are made on the create path when the warm pool is
empty. The binding is the few C functions Debian's python3-nftables wraps the same way; that
module is not importable from the server's own Python.

Owns: one libnftables context per `Nft`, used under a lock (a context is not thread-safe).
Its netlink socket talks to the network namespace of the thread that ran the first command:
callers must run every command from the host's namespace.
Must not touch: any table a caller does not name in a command.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from aenv.errors import AenvError, ErrorCode


class Nft:
    """Runs nft command buffers (each buffer is one atomic transaction)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._ctx: int | None = None

    def _context(self) -> tuple[ctypes.CDLL, int]:
        if self._lib is None or self._ctx is None:
            name = ctypes.util.find_library("nftables") or "libnftables.so.1"
            try:
                lib = ctypes.CDLL(name)
            except OSError as exc:
                raise AenvError(ErrorCode.INTERNAL,
                                f"network: libnftables is missing ({exc})") from exc
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
            lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT
            if not ctx:
                raise AenvError(ErrorCode.INTERNAL, "network: nft_ctx_new failed")
            # Output and errors into buffers, never onto the server's stdout/stderr.
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            self._lib, self._ctx = lib, ctx
        return self._lib, self._ctx

    def run(self, commands: str) -> str:
        """Run `commands` (nft syntax) as one transaction; returns the output, raises
        AenvError(INTERNAL) with nft's message if the kernel or the parser refused it."""
        with self._lock:
            lib, ctx = self._context()
            rc = lib.nft_run_cmd_from_buffer(ctx, commands.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        if rc != 0:
            raise AenvError(ErrorCode.INTERNAL, f"network: nft refused: {err.strip()}")
        return out

    def close(self) -> None:
        with self._lock:
            if self._lib is not None and self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
            self._lib = self._ctx = None
