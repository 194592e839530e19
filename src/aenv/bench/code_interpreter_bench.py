"""The code interpreter through the official `e2b-code-interpreter` SDK (2.11): `run_code("1+1")`
round trip (the SDK opens a connection per call: proxy, sandbox port 49999, kernel and back;
target p50 <= 15 ms) and create -> first result (`Sandbox.create()` of `code-interpreter-v1`
until the first `run_code` returned its result: a restore of the template's snapshot, whose
kernel is already running). The template build (first use) is timed once, on its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from aenv.bench.stats import summarize
from aenv.devserver import ServerProcess, run_with_server

ROUNDS = 200  # run_code round trips
CREATES = 15
BUILD_TIMEOUT_S = 1800


def run(rounds: int = ROUNDS, creates: int = CREATES) -> Iterator[str]:
    from e2b_code_interpreter import Sandbox

    t = time.perf_counter()
    first = Sandbox.create(timeout=600, request_timeout=BUILD_TIMEOUT_S)
    build_s = time.perf_counter() - t
    try:
        assert first.run_code("1+1").text == "2"
        for _ in range(10):  # warm-up: the proxy's pool, the kernel's first cells
            first.run_code("1+1")
        trips = []
        for _ in range(rounds):
            t = time.perf_counter()
            execution = first.run_code("1+1")
            trips.append(time.perf_counter() - t)
            assert execution.text == "2", execution
    finally:
        first.kill()
    to_result = []
    for _ in range(creates):
        t = time.perf_counter()
        sbx = Sandbox.create(timeout=120)
        text = sbx.run_code("1+1").text
        to_result.append(time.perf_counter() - t)
        assert text == "2"
        sbx.kill()
    yield f"  {'first create (builds code-interpreter-v1)':<50} {build_s:.2f} s"
    yield summarize('  run_code("1+1") round trip', trips).line()
    yield summarize("  create -> first run_code result", to_result).line()


def main() -> int:
    def body(_: ServerProcess) -> Iterator[str]:
        yield "[code interpreter]"
        yield from run()

    return run_with_server("aenv-ci-bench-", "code interpreter through e2b-code-interpreter "
                           "2.11 (template code-interpreter-v1):", body)


if __name__ == "__main__":
    raise SystemExit(main())
