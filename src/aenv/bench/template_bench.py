"""Create-from-template latency, through the official E2B SDK: a template built with
`Template.build` (COPY, RUN, and a start command serving HTTP) is a snapshot, so creating a
sandbox from it is a restore. Printed next to a plain create (a boot) and a create from a
snapshot of an equivalent sandbox (the same restore, taken by hand): the last two should match.
Each sample is `Sandbox.create` until the SDK returns (envd answers), then a kill (not timed);
the three kinds are interleaved.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from aenv.bench.stats import summarize
from aenv.devserver import ServerProcess, run_with_server

ROUNDS = 20
START = "python3 -m http.server 8080"
READY = "curl -sf http://127.0.0.1:8080/"


def _timed_creates(template: str, rounds: int) -> list[float]:
    from e2b import Sandbox

    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        sbx = Sandbox.create(template, timeout=120)
        samples.append(time.perf_counter() - t)
        sbx.kill()
    return samples


def run(rounds: int = ROUNDS) -> Iterator[str]:
    from e2b import Sandbox, Template

    with tempfile.TemporaryDirectory() as ctx:
        (Path(ctx) / "app.txt").write_text("served by the template's start command\n")
        template = (Template(file_context_path=ctx).from_template("base")
                    .copy("app.txt", "/home/user/")
                    .run_cmd("python3 -c 'print(42)' > /home/user/built.txt")
                    .set_start_cmd(START, READY))
        t = time.perf_counter()
        info = Template.build(template, "bench-template")
        build_s = time.perf_counter() - t
    src = Sandbox.create(timeout=300)
    src.commands.run(f"nohup {START} >/dev/null 2>&1 &")
    src.commands.run(f"for i in $(seq 100); do {READY} >/dev/null && break; sleep 0.1; done")
    snapshot = src.create_snapshot()
    src.kill()
    _timed_creates("base", 2)  # warm-up
    plain: list[float] = []
    restored: list[float] = []
    built: list[float] = []
    for _ in range(rounds):  # interleaved: a change in host load hits all three alike
        plain += _timed_creates("base", 1)
        restored += _timed_creates(snapshot.snapshot_id, 1)
        built += _timed_creates(info.template_id, 1)
    Sandbox.delete_snapshot(snapshot.snapshot_id)
    yield f"  {'template build (COPY, RUN, start + ready command)':<50} {build_s:.2f} s"
    yield summarize("  create, plain (boot)", plain).line()
    yield summarize("  create from a snapshot (restore)", restored).line()
    yield summarize("  create from a built template", built).line()


def main() -> int:
    def body(_: ServerProcess) -> Iterator[str]:
        yield "[templates]"
        yield from run()

    return run_with_server("aenv-template-bench-", "container runtime: create from a built "
                           "template vs a boot and a snapshot restore, through the e2b SDK 2.63:",
                           body)


if __name__ == "__main__":
    raise SystemExit(main())
