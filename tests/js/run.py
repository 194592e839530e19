"""Run the JavaScript SDK suite (`tests/js/*.test.mjs`) against a real `aenv serve`.

A fresh home and server (`aenv.devserver.sdk_server`), the E2B environment variables
exported to `node --test`, and everything removed afterwards: the same frame the Python e2e
suites use. `make test-js` runs it after `npm ci`. Extra arguments go to `node --test`
(e.g. a single file). With AENV_JS_SERVER=<url> it runs against an already running server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: sandbox_helpers

from sandbox_helpers import runtime_env

from aenv.devserver import sdk_server


def node_test(args: list[str], env: dict[str, str]) -> int:
    files = args or sorted(str(p) for p in HERE.glob("*.test.mjs"))
    cmd = ["node", "--test", "--test-concurrency=1", "--test-reporter=spec", *files]
    return subprocess.run(cmd, cwd=HERE, env=env, check=False).returncode


def main(args: list[str]) -> int:
    existing = os.environ.get("AENV_JS_SERVER")
    if existing:
        return node_test(args, {**os.environ, "E2B_API_URL": existing, "E2B_SANDBOX_URL": existing})
    with sdk_server("aenv-js-", extra_env=runtime_env(AENV_SANDBOX_MAX_SANDBOXES="100")) as server:
        return node_test(args, {**os.environ, **server.sdk_env()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
