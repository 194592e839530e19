"""`make run`: start a server on the embedded defaults, drive it with the official E2B SDK,
print what happened and how long each step took, then stop the server."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from aenv.config import default_home
from aenv.devserver import ServerProcess


@contextmanager
def step(what: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    print(f"  {what:<52} {1000 * (time.perf_counter() - started):8.1f} ms")


def main() -> int:
    home = Path(os.environ.get("AENV_HOME") or default_home())
    print(f"starting aenv server (home {home}); the first start builds the base template")
    server = ServerProcess(home=home, log_path=Path(tempfile.gettempdir()) / "aenv-demo-server.log")
    t0 = time.perf_counter()
    with server.start(show_output=True):
        print(f"server ready at {server.url} in {time.perf_counter() - t0:.1f} s\n")
        os.environ.update(server.sdk_env())
        from e2b import Sandbox

        with step("Sandbox.create() (base template)"):
            sbx = Sandbox.create(metadata={"demo": "yes"}, envs={"GREETING": "hello"})
        print(f"    sandbox {sbx.sandbox_id}")
        with step('commands.run("echo $GREETING from $(hostname)")'):
            out = sbx.commands.run("echo $GREETING from $(hostname)")
        print(f"    -> {out.stdout.strip()}")
        with step('commands.run("uname -sr; id -un")'):
            out = sbx.commands.run("uname -sr; id -un")
        print(f"    -> {' | '.join(out.stdout.split())}")
        with step("files.write + files.read"):
            sbx.files.write("/home/user/notes.txt", "written through the E2B SDK\n")
            text = sbx.files.read("/home/user/notes.txt")
        print(f"    -> {text.strip()}")
        with step("python3 inside the sandbox"):
            out = sbx.commands.run("python3 -c 'import sys; print(sys.version.split()[0])'")
        print(f"    -> Python {out.stdout.strip()}")
        with step("ps (the sandbox sees only its own processes)"):
            out = sbx.commands.run("ps -e --no-headers | wc -l")
        print(f"    -> {out.stdout.strip()} processes visible")
        with step("Sandbox.list()"):
            listed = Sandbox.list().next_items()
        print(f"    -> {len(listed)} sandbox(es) running")
        with step("kill()"):
            sbx.kill()
    print("\nserver stopped. Next: `make test`, or `.venv/bin/aenv serve` and the E2B SDK with")
    print("  E2B_API_URL / E2B_SANDBOX_URL = http://127.0.0.1:8000 and E2B_API_KEY from the server")
    return 0


if __name__ == "__main__":
    sys.exit(main())
