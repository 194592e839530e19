"""Container runtime, measured through the official E2B SDK against a real server:

- create -> envd ready (the SDK's `Sandbox.create` returns only when envd answers),
  sequentially (0.1 s apart) and in bursts of 16 concurrent creates (2 s apart: the server's
  ready pool of 16 started sandboxes refills once it is idle);
- `commands.run("true")` round trip;
- host memory per idle sandbox (drop of MemAvailable over N idle sandboxes, and the sum of
  the sandboxes' cgroup memory usage), after the page cache settles.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from aenv.bench.stats import mem_available, summarize
from aenv.devserver import ServerProcess, run_with_server

SETTLE_S = 2.0  # between bursts: the ready pool refills (~0.5 s for 16 sandboxes)


def raw_http_burst(server: ServerProcess, rounds: int = 3, size: int = 16) -> list[float]:
    """16 concurrent `POST /v2/sandboxes` from one asyncio client. The E2B SDK's client is
    heavy (16 threads of it share the GIL and the same 2 cores as the server), so this shows
    what the server itself takes: it answers 201 only once envd accepts requests."""
    import asyncio

    import httpx

    async def burst() -> list[float]:
        headers = {"X-API-Key": server.api_key}
        limits = httpx.Limits(max_connections=size)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits,
                                     timeout=60) as http:
            async def one() -> tuple[float, str]:
                t = time.perf_counter()
                resp = await http.post("/v2/sandboxes", json={"templateID": "base"})
                resp.raise_for_status()
                return time.perf_counter() - t, str(resp.json()["sandboxID"])

            out: list[float] = []
            for _ in range(rounds):
                await asyncio.sleep(SETTLE_S)
                results = await asyncio.gather(*[one() for _ in range(size)])
                out.extend(dt for dt, _ in results)
                await asyncio.gather(*[http.delete(f"/sandboxes/{sid}") for _, sid in results])
            return out

    return asyncio.run(burst())


def run(server: ServerProcess) -> list[str]:
    from e2b import Sandbox

    lines: list[str] = []

    def timed_create() -> tuple[float, Sandbox]:
        t = time.perf_counter()
        sbx = Sandbox.create()
        return time.perf_counter() - t, sbx

    # warm-up (first create pays one-off costs such as page-cache misses on the template)
    _, warm = timed_create()
    warm.kill()

    seq: list[float] = []
    for _ in range(30):
        dt, sbx = timed_create()
        seq.append(dt)
        sbx.kill()
        time.sleep(0.1)
    lines.append(summarize("create -> envd ready, sequential", seq).line())

    conc: list[float] = []
    for _ in range(3):
        time.sleep(SETTLE_S)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: timed_create(), range(16)))
        conc.extend(dt for dt, _ in results)
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda r: r[1].kill(), results))
    lines.append(summarize("create -> envd ready, 16 concurrent", conc).line())
    lines.append(summarize("  same, raw HTTP client (no SDK client CPU)", raw_http_burst(server)).line())

    sbx = Sandbox.create()
    for _ in range(20):
        sbx.commands.run("true")
    rtt: list[float] = []
    for _ in range(300):
        t = time.perf_counter()
        sbx.commands.run("true")
        rtt.append(time.perf_counter() - t)
    lines.append(summarize('commands.run("true") round trip', rtt).line())
    sbx.kill()

    n = 30
    time.sleep(SETTLE_S)  # the ready pool is full before and after: not counted
    before = mem_available()
    idle = [Sandbox.create() for _ in range(n)]
    time.sleep(3)
    after = mem_available()
    per = (before - after) / n / 2**20
    lines.append(f"{'host memory per idle sandbox (MemAvailable drop / N)':<52} N={n}  {per:.2f} MiB")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: s.kill(), idle))
    return lines


def main() -> int:
    return run_with_server("aenv-bench-", "container runtime, through the e2b SDK 2.63 (2 cores):",
                           run)
