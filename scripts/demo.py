"""`make run`: start a server on the embedded defaults, drive it with the official E2B SDK
through what sets aenv apart (a setup, pause -> resume with a process still running, fork x16,
snapshot -> create from it), print each step with its time, then stop the server."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from aenv.config import default_home
from aenv.devserver import ServerProcess

FILES = 300
# A setup as an agent's environment would have one: a small project of a few hundred files,
# byte-compiled, and a process that keeps running (here: counting, ten times a second).
SETUP = (f"mkdir -p ~/app && cd ~/app && for i in $(seq 1 {FILES}); do "
         "printf 'def f%d():\\n    return %d\\n' $i $i > mod_$i.py; done && "
         "python3 -m compileall -q . && ls ~/app/*.py | wc -l")
COUNTER = "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done'"
ANSWER = 'echo "$(hostname): $(ls ~/app/*.py | wc -l) files, counter at $(cat /tmp/counter)"'


@contextmanager
def step(what: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    print(f"  {what:<58} {1000 * (time.perf_counter() - started):8.1f} ms")


def show(text: str) -> None:
    print(f"      -> {text}")


def main() -> int:
    home = Path(os.environ.get("AENV_HOME") or default_home())
    print(f"starting aenv server (home {home}); the first start builds the base template")
    server = ServerProcess(home=home, log_path=Path(tempfile.gettempdir()) / "aenv-demo-server.log")
    t0 = time.perf_counter()
    with server.start(show_output=True):
        print(f"server ready at {server.url} in {time.perf_counter() - t0:.1f} s\n")
        os.environ.update(server.sdk_env())
        from e2b import Sandbox

        demo_started = time.perf_counter()
        made: list[Sandbox] = []
        try:
            print("a sandbox")
            with step("Sandbox.create()"):
                sbx = Sandbox.create(metadata={"demo": "yes"}, timeout=300)
                made.append(sbx)
            show(f"sandbox {sbx.sandbox_id}")
            with step('commands.run("uname -sr; id -un; python3 -V")'):
                out = sbx.commands.run("uname -sr; id -un; python3 -V")
            show(" | ".join(out.stdout.strip().splitlines()))

            print("\na setup: files, byte-compiled, and a process that keeps counting")
            with step(f"commands.run(write {FILES} files + compileall)"):
                out = sbx.commands.run(SETUP)
            show(f"{out.stdout.strip()} python files in ~/app")
            with step("commands.run(counter, background=True)"):
                counter = sbx.commands.run(COUNTER, background=True, timeout=0)
                counter.disconnect()  # it runs on; we only read /tmp/counter
            time.sleep(0.5)
            show(f"counter at {sbx.files.read('/tmp/counter').strip()}")

            print("\npause -> resume: memory and processes kept, nothing running in between")
            before = sbx.files.read("/tmp/counter").strip()
            with step("pause()"):
                sbx.pause()
            time.sleep(1)  # paused: the counter does not move
            with step("Sandbox.connect() (resume)"):
                sbx = Sandbox.connect(sbx.sandbox_id)
            resumed = sbx.files.read("/tmp/counter").strip()
            time.sleep(0.5)
            show(f"counter {before} before the pause, {resumed} after the resume, "
                 f"{sbx.files.read('/tmp/counter').strip()} half a second later")

            print("\nfork x16: sixteen copies of the running sandbox, each answering on its own")
            with step("fork(count=16) -> all 16 running"):
                results = sbx.fork(count=16)
            children = [c for c in results if isinstance(c, Sandbox)]
            made.extend(children)
            if len(children) != 16:
                show(f"{16 - len(children)} children failed: "
                     f"{[r for r in results if not isinstance(r, Sandbox)][:2]}")
            with step("commands.run(...) in each child, at once"), ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda c: c.commands.run(ANSWER).stdout.strip(), children))
            for answer in answers:
                show(answer)
            show(f"parent {sbx.sandbox_id} goes on: counter at "
                 f"{sbx.files.read('/tmp/counter').strip()}")

            print("\nsnapshot -> a new sandbox from it (any time later, on any node)")
            sbx.files.write("/home/user/app/NOTE", "written before the snapshot\n")
            with step("create_snapshot()"):
                snap = sbx.create_snapshot()
            show(f"snapshot {snap.snapshot_id}")
            with step("Sandbox.create(snapshot_id)"):
                copy = Sandbox.create(snap.snapshot_id, timeout=120)
                made.append(copy)
            show(copy.commands.run(ANSWER + "; cat ~/app/NOTE").stdout.strip().replace("\n", " | "))

            with step(f"kill() x{len(made)}, delete_snapshot()"):
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda s: s.kill(), made))
                made.clear()
                Sandbox.delete_snapshot(snap.snapshot_id)
            print(f"\nall of the above in {time.perf_counter() - demo_started:.1f} s")
        finally:
            for s in made:
                s.kill()
    print("\nserver stopped. Next: `make test`, or `.venv/bin/aenv serve` and the E2B SDK with")
    print("  E2B_API_URL / E2B_SANDBOX_URL = http://127.0.0.1:8000 and E2B_API_KEY from the server;")
    print("  examples/ has RL rollouts with aenv.rollouts (best-of-N, tree search).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
