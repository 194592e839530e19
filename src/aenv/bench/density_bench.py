"""Density: how many idle sandboxes one node holds, running and paused, and what that costs.

`python -m aenv.bench.density_bench [--running 1000] [--paused 10000] [--concurrency 4]`:
on a fresh home, creates `--running` idle sandboxes and keeps them running, then measures
create latency (p50/p99, and how it drifts as the node fills), the host memory each one
takes (MemAvailable drop / count, and the mean of their memory cgroups), the server's own
resident memory and CPU while they idle (the liveness monitor, envd health checks and TTL
sweeper run over all of them), `commands.run("true")` p50/p99 on a sample, and list latency.
Then it creates and pauses sandboxes until `--paused` are paused (in batches, each batch
paused as soon as it is created) and measures the paused images' disk use, list latency,
the server's idle CPU and memory again, and a sample of resumes. Everything it made is
removed at the end. Traffic stays on loopback.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import httpx

from aenv.bench.stats import mem_available, summarize
from aenv.devserver import ServerProcess, prepare_home, remove_home
from aenv.storage.usage import allocated_bytes

CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")
R = TypeVar("R")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _server_idle(pid: int, seconds: float) -> tuple[float, int]:
    """The server's CPU use (fraction of one core) over `seconds` of idling, and its RSS."""
    cpu0, t0 = _proc_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (_proc_cpu_s(pid) - cpu0) / (time.monotonic() - t0), _rss_bytes(pid)


def _cgroup_memory(sandbox_id: str) -> int | None:
    path = Path(f"/sys/fs/cgroup/memory/aenv/{sandbox_id}/memory.usage_in_bytes")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


class Bench:
    def __init__(self, srv: ServerProcess, concurrency: int) -> None:
        self.srv = srv
        self.concurrency = concurrency
        self.http = httpx.Client(base_url=srv.url, headers={"X-API-Key": srv.api_key},
                                 timeout=300, limits=httpx.Limits(max_connections=32))

    def create(self) -> tuple[str, float]:
        t0 = time.monotonic()
        resp = self.http.post("/sandboxes", json={"templateID": "base", "timeout": 3600,
                                                  "autoPause": False})
        resp.raise_for_status()
        return resp.json()["sandboxID"], time.monotonic() - t0

    def pause(self, sandbox_id: str) -> float:
        t0 = time.monotonic()
        resp = self.http.post(f"/sandboxes/{sandbox_id}/pause")
        resp.raise_for_status()
        return time.monotonic() - t0

    def many(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(fn, items))

    def list_all(self, state: str) -> tuple[int, float]:
        t0 = time.monotonic()
        count, token = 0, None
        while True:
            params: dict[str, str | int] = {"state": state, "limit": 1000}
            if token:
                params["nextToken"] = token
            resp = self.http.get("/v2/sandboxes", params=params)
            resp.raise_for_status()
            count += len(resp.json())
            token = resp.headers.get("x-next-token")
            if not token:
                return count, time.monotonic() - t0

    def command_latency(self, ids: list[str], samples: int) -> list[float]:
        from e2b import Sandbox

        out = []
        for sid in random.sample(ids, min(samples, len(ids))):
            sbx = Sandbox.connect(sid, api_key=self.srv.api_key, api_url=self.srv.url,
                                  sandbox_url=self.srv.url)
            t0 = time.monotonic()
            assert sbx.commands.run("true", timeout=60).exit_code == 0
            out.append(time.monotonic() - t0)
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=1000)
    parser.add_argument("--paused", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)

    home = prepare_home("aenv-density-")
    limit = args.running + args.paused + 100
    srv = ServerProcess(home=home, api_key="density-key", extra_env={
        "AENV_SANDBOX_MAX_SANDBOXES": str(limit),
        "AENV_RUNTIME_READY_POOL": "0"}).start(ready_timeout=600)
    assert srv.proc is not None
    pid = srv.proc.pid
    bench = Bench(srv, args.concurrency)
    print(f"density on {home} (server pid {pid}): {args.running} running, "
          f"{args.paused} paused, concurrency {args.concurrency}")
    try:
        cpu, rss0 = _server_idle(pid, 3)
        mem0 = mem_available()
        running: list[str] = []
        latencies: list[float] = []
        t0 = time.monotonic()
        for start in range(0, args.running, 100):
            batch = bench.many(lambda _i: bench.create(), range(start, min(start + 100,
                                                                          args.running)))
            running += [sid for sid, _ in batch]
            lat = [s for _, s in batch]
            latencies += lat
            print(f"  {len(running):5d} running: create p50 "
                  f"{summarize('c', lat).p50_ms:7.1f} ms, p99 {summarize('c', lat).p99_ms:7.1f} ms,"
                  f" host available {mem_available() / 2**30:6.2f} GiB", flush=True)
        print(summarize(f"create (0 -> {args.running} running)", latencies).line())
        print(f"  {args.running} creates in {time.monotonic() - t0:.1f} s")
        time.sleep(5)  # let the last ones settle (first health checks, pool refills)
        used = mem0 - mem_available()
        cgroup = [m for m in map(_cgroup_memory, running) if m is not None]
        cpu, rss = _server_idle(pid, args.idle_seconds)
        print(f"  host memory per running sandbox: {used / len(running) / 2**20:.1f} MiB "
              f"(MemAvailable drop); memory cgroup mean "
              f"{sum(cgroup) / max(1, len(cgroup)) / 2**20:.1f} MiB")
        print(f"  server idle with {len(running)} running: CPU {cpu * 100:.1f} % of a core, "
              f"RSS {rss / 2**20:.0f} MiB (was {rss0 / 2**20:.0f} MiB)")
        n, took = bench.list_all("running")
        print(f"  list of {n} running sandboxes (pages of 1000): {took * 1e3:.0f} ms")
        print(summarize(f"commands.run('true') with {len(running)} running",
                        bench.command_latency(running, args.samples)).line())

        if args.paused <= 0:
            return 0
        paused: list[str] = []
        pause_lat: list[float] = []
        t0 = time.monotonic()
        while len(paused) < args.paused:
            size = min(100, args.paused - len(paused))
            made = [sid for sid, _ in bench.many(lambda _i: bench.create(), range(size))]
            pause_lat += bench.many(bench.pause, made)
            paused += made
            if len(paused) % 1000 == 0 or len(paused) == args.paused:
                print(f"  {len(paused):5d} paused ({time.monotonic() - t0:.0f} s); pause p50 "
                      f"{summarize('p', pause_lat[-size:]).p50_ms:.1f} ms", flush=True)
        print(summarize(f"pause (0 -> {args.paused} paused, {len(running)} running)",
                        pause_lat).line())
        disk = sum(allocated_bytes(home / "sandboxes" / sid / "checkpoints")
                   for sid in random.sample(paused, min(200, len(paused))))
        print(f"  paused image on disk: {disk / min(200, len(paused)) / 2**20:.2f} MiB each "
              f"(sample of {min(200, len(paused))})")
        n, took = bench.list_all("paused")
        print(f"  list of {n} paused sandboxes (pages of 1000): {took * 1e3:.0f} ms")
        cpu, rss = _server_idle(pid, args.idle_seconds)
        print(f"  server idle with {len(running)} running + {len(paused)} paused: "
              f"CPU {cpu * 100:.1f} % of a core, RSS {rss / 2**20:.0f} MiB")
        resumes = []
        for sid in random.sample(paused, min(20, len(paused))):
            t1 = time.monotonic()
            bench.http.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}
                            ).raise_for_status()
            resumes.append(time.monotonic() - t1)
        print(summarize(f"resume with {len(paused)} paused", resumes).line())
    except Exception:
        log = (home / "server.log").read_text(errors="replace").splitlines()
        print("server log (errors):", *[line for line in log if "ERROR" in line
                                          or "Error" in line][-20:], sep="\n  ")
        raise
    finally:
        t0 = time.monotonic()
        srv.shutdown()
        print(f"  cleanup {time.monotonic() - t0:.0f} s")
        remove_home(home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
