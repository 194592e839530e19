"""Measure envd: idle memory and `commands.run("true")` round trips through the SDK.

    .venv/bin/python tests/envd/bench_envd.py [--runs 200]

Not collected by pytest (no `test_` prefix). Prints:
- RSS / anonymous RSS / private (USS) of an idle `python -m aenv.envd`;
- the private memory of an envd forked from a process that called `preload()` (the fork
  server model: imported code is shared);
- p50/p90/p99 of `Sandbox.commands.run("true")` against envd directly, and of the bare
  `bash -l -c true` it runs, for comparison.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from envd_helpers import SRC, TEST_USER, Envd, ensure_test_user, free_port, make_sandbox, start_envd


def memory(pid: int) -> dict[str, int]:
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0])
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Private_Clean", "Private_Dirty", "Pss"):
                values[key] = int(rest.split()[0])
    values["USS"] = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)
    return values


def show(label: str, values: dict[str, int]) -> None:
    keys = ("VmRSS", "RssAnon", "Pss", "USS")
    print(f"{label:42s} " + "  ".join(f"{k}={values.get(k, 0) / 1024:.1f}MiB" for k in keys))


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000
    return f"p50={statistics.median(ordered) * 1000:.1f}ms p90={pick(0.9):.1f}ms p99={pick(0.99):.1f}ms"


def forked_envd(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A parent that preloads then forks one envd child (a fork server in miniature)."""
    port = free_port()
    script = textwrap.dedent(
        f"""
        import os, socket, sys, time
        sys.path.insert(0, {str(SRC)!r})
        from aenv.envd.server import preload, run
        from aenv.envd.settings import EnvdSettings
        preload()
        sock = socket.socket()
        sock.bind(("127.0.0.1", {port}))
        sock.listen(16)
        if os.fork() == 0:
            run(EnvdSettings(default_user={TEST_USER!r}, is_init=False), listen_socket=sock)
            os._exit(0)
        time.sleep(3600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    return process, port


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    runs = parser.parse_args().runs
    ensure_test_user()
    tmp = Path(tempfile.mkdtemp(prefix="envd-bench-"))

    envd = start_envd(tmp, extra=["--not-init"])
    time.sleep(0.5)
    show("idle envd (python -m aenv.envd)", memory(envd.process.pid))

    sbx = make_sandbox(envd)
    for _ in range(10):
        sbx.commands.run("true")
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        sbx.commands.run("true")
        samples.append(time.perf_counter() - started)
    print(f"commands.run('true') via SDK, {runs} runs: {percentiles(samples)}")
    show("envd after the runs", memory(envd.process.pid))
    envd.stop()

    bare = []
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": f"/home/{TEST_USER}"}
    for _ in range(50):
        started = time.perf_counter()
        subprocess.run(["setpriv", "--reuid", TEST_USER, "--regid", TEST_USER, "--init-groups", "/bin/bash", "-l", "-c", "true"],
                       env=env, cwd=f"/home/{TEST_USER}", check=True)
        bare.append(time.perf_counter() - started)
    print(f"bare `bash -l -c true` as {TEST_USER} (subprocess): {percentiles(bare)}")

    parent, port = forked_envd(tmp)
    children = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True, check=False).stdout.split()
    time.sleep(0.5)
    if children:
        child = int(children[0])
        show("fork-server parent (after preload)", memory(parent.pid))
        show("forked envd child, idle", memory(child))
        forked = Envd(port, None, parent, tmp / "unused", tmp)
        fsbx = make_sandbox(forked)
        for _ in range(20):
            fsbx.commands.run("true")
        show("forked envd child after 20 runs", memory(child))
        os.kill(child, 15)
    parent.kill()
    parent.wait()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
