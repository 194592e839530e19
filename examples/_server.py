"""Where the examples find a server: the E2B SDK's environment (E2B_API_URL, E2B_API_KEY, ...)
if set, e.g. for `aenv serve`; otherwise a temporary local server for the example's duration."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def aenv_server() -> Iterator[None]:
    if os.environ.get("E2B_API_URL"):
        yield
        return
    from aenv.devserver import sdk_server

    print("E2B_API_URL is not set: starting a temporary aenv server")
    with sdk_server("aenv-example-"):
        yield
