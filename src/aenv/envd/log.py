"""stderr logging for envd, without the `logging` package (it costs ~1 MiB per instance).

Owns: one line per event on stderr; tracebacks of unexpected failures go here and never to
a client.
"""

from __future__ import annotations

import sys
import time
import traceback


def log(message: str) -> None:
    # UTC with milliseconds: the host reads these lines as the sandbox's log (GET .../logs).
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    try:
        sys.stderr.write(f"{stamp} envd: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        # stderr may be closed in a detached sandbox; losing a log line is fine.
        pass


def log_exception(context: str, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log(f"{context}: unexpected error\n{text.rstrip()}")
