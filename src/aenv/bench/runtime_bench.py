"""Container runtime driver benchmark, below the API: `ContainerDriver` used directly.

- create -> envd ready (create() returns when envd's socket accepts), and create -> first
  `GET /health` answered by envd, sequentially and in bursts of 16 concurrent creates;
- host CPU per create (cgroup cpuacct of the sandboxes + this process and its fork-server);
- host memory per idle sandbox: the drop of MemAvailable over N idle sandboxes, and the sum
  of their processes' PSS (proportional set size: shared pages split among sharers) / N.

With --ready-pool N the driver keeps N started sandboxes of the benchmark's shape (what the
server does for the default template): creates claim them; the pool refills between bursts.

Usage (root): python -m aenv.bench.runtime_bench [--rootfs DIR] [--idle 30] [--rounds 5]
              [--internet] [--ready-pool N]
Owns: nothing but its temporary AENV home and the sandboxes it makes (all destroyed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import string
import tempfile
import time
from pathlib import Path

from aenv.bench.stats import mem_available, summarize
from aenv.config import Config
from aenv.runtime.base import ReadyShape, RuntimeHandle, SandboxSpec
from aenv.runtime.container.driver import ContainerDriver

_BENCH_CGROUP = Path("/sys/fs/cgroup/cpuacct/aenv-bench")


def _id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(20))


def pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_ms(path: Path) -> float:
    try:
        return int((path / "cpuacct.usage").read_text()) / 1e6
    except OSError:
        return 0.0


class Bench:
    def __init__(self, rootfs: Path, home: Path, internet: bool, warm_pool: int | None,
                 ready_pool: int = 0) -> None:
        cfg = Config()
        cfg.server.home = home
        if warm_pool is not None:
            cfg.runtime.warm_pool = warm_pool
        cfg.runtime.ready_pool = ready_pool
        self.driver = ContainerDriver(cfg)
        self.ready_pool = ready_pool
        self.rootfs = rootfs
        self.home = home
        self.internet = internet
        self.verbose = False

    def spec(self) -> SandboxSpec:
        sid = _id()
        return SandboxSpec(sandbox_id=sid, lower_layers=(self.rootfs,),
                           workspace=self.home / "sandboxes" / sid, cpu_count=1, memory_mb=512,
                           pids_max=1024, default_user="root",
                           allow_internet_access=self.internet)

    async def health(self, handle: RuntimeHandle) -> None:
        sock = await self.driver.connect(handle, 49983)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
        status = await reader.readline()
        writer.close()
        if b" 204 " not in status:
            raise RuntimeError(f"envd answered {status!r}")

    async def one(self) -> tuple[RuntimeHandle, float, float]:
        t = time.perf_counter()
        handle = await self.driver.create(self.spec())
        ready = time.perf_counter() - t
        await self.health(handle)
        return handle, ready, time.perf_counter() - t

    def shape(self) -> ReadyShape:
        s = self.spec()
        return ReadyShape(lower_layers=s.lower_layers, cpu_count=s.cpu_count,
                          memory_mb=s.memory_mb, pids_max=s.pids_max,
                          allow_internet_access=s.allow_internet_access,
                          envd_port=s.envd_port, default_user=s.default_user)

    async def settle(self) -> None:
        # Let the fork-server refill its warm pool and the kernel finish tearing down.
        await asyncio.sleep(1.5)
        await self.pool_full()

    async def pool_full(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.driver.ready_count() < self.ready_pool and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def sequential(self, n: int) -> list[str]:
        ready, health = [], []
        for _ in range(n):
            handle, r, h = await self.one()
            ready.append(r)
            health.append(h)
            await self.driver.destroy(handle)
            await asyncio.sleep(0.1)
        return [summarize("sequential create -> envd ready", ready).line(),
                summarize("sequential create -> first /health answered", health).line()]

    async def burst(self, rounds: int, size: int = 16) -> list[str]:
        ready: list[float] = []
        health: list[float] = []
        cpu: list[float] = []
        for _ in range(rounds):
            await self.settle()
            before = cpu_ms(_BENCH_CGROUP)
            results = await asyncio.gather(*[self.one() for _ in range(size)])
            spent = cpu_ms(_BENCH_CGROUP) - before
            # A claimed pool sandbox started envd before the burst: count from its claim.
            spent += sum(cpu_ms(Path("/sys/fs/cgroup/cpuacct/aenv") / h.sandbox_id)
                         - (self.driver._live[h.sandbox_id].cpu_used or 0) / 1e6
                         for h, _, _ in results)
            cpu.append(spent / size)
            if self.verbose:
                rs = sorted(r * 1000 for _, r, _ in results)
                print(f"  burst: ready p50 {rs[len(rs) // 2]:.1f} max {rs[-1]:.1f} ms,"
                      f" cpu/create {spent / size:.1f} ms, load {os.getloadavg()[0]:.1f}",
                      flush=True)
            ready += [r for _, r, _ in results]
            health += [h for _, _, h in results]
            await asyncio.gather(*[self.driver.destroy(h) for h, _, _ in results])
        return [summarize(f"{size} concurrent: create -> envd ready", ready).line(),
                summarize(f"{size} concurrent: create -> first /health answered", health).line(),
                (f"{'host CPU per create (burst, on the create path)':<52} "
                f"{sum(cpu) / len(cpu):.1f} ms")]

    async def memory(self, n: int) -> list[str]:
        await self.settle()
        base = mem_available()
        handles = []
        for _ in range(n):
            handles.append((await self.one())[0])
        await asyncio.sleep(3)  # idle: envd started, page cache settled, warm pool refilled
        await self.pool_full()  # as full as at the start: pool sandboxes are not counted
        drop = base - mem_available()
        pids = []
        for h in handles:
            procs = Path(f"/sys/fs/cgroup/pids/aenv/{h.sandbox_id}/cgroup.procs").read_text()
            pids += [int(p) for p in procs.split()]
        total_pss = sum(pss(p) for p in pids)
        usage = sum(int(Path(f"/sys/fs/cgroup/memory/aenv/{h.sandbox_id}/memory.usage_in_bytes")
                        .read_text()) for h in handles)
        await asyncio.gather(*[self.driver.destroy(h) for h in handles])
        mib = 2**20
        return [f"{'idle sandboxes':<52} n={n}",
                f"{'host memory per idle sandbox (MemAvailable drop)':<52} {drop / n / mib:.2f} MiB",
                (f"{'PSS per idle sandbox (sum over its processes)':<52} "
                f"{total_pss / n / mib:.2f} MiB"),
                f"{'cgroup memory.usage per idle sandbox':<52} {usage / n / mib:.2f} MiB"]


async def main_async(args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix="aenv-runtime-bench-"))
    _BENCH_CGROUP.mkdir(exist_ok=True)
    # This process and its fork-server (a child) are accounted here; sandboxes move out.
    (_BENCH_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    bench = Bench(args.rootfs, home, args.internet, args.warm_pool, args.ready_pool)
    bench.verbose = args.verbose
    await bench.driver.start()
    if args.ready_pool:
        bench.driver.set_ready_shapes([bench.shape()])
    try:
        await bench.settle()
        warm_up, _, _ = await bench.one()  # page cache of the template and the bundle
        await bench.driver.destroy(warm_up)
        slots = (f", {bench.driver.config.runtime.warm_pool} warm slots" if args.internet
                 else "")
        slots += (f", ready pool of {args.ready_pool} started sandboxes" if args.ready_pool
                  else ", fork-server only")
        lines = [(f"container runtime ({'with' if args.internet else 'no'} internet{slots},"
                 f" {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.2f} at start)")]
        lines += await bench.sequential(args.sequential)
        lines += await bench.burst(args.rounds)
        lines += await bench.memory(args.idle)
        print("\n".join(lines))
    finally:
        await bench.driver.close()
        shutil.rmtree(home, ignore_errors=True)
        (Path("/sys/fs/cgroup/cpuacct/cgroup.procs")).write_text(str(os.getpid()))
        _BENCH_CGROUP.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.bench.runtime_bench")
    parser.add_argument("--rootfs", type=Path, default=None,
                        help="lower layer (default: the cached base template layer)")
    parser.add_argument("--sequential", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=int, default=30)
    parser.add_argument("--internet", action="store_true",
                        help="sandboxes get network slots (pool of config runtime.warm_pool)")
    parser.add_argument("--warm-pool", type=int, default=None,
                        help="network slots kept ready (default: config runtime.warm_pool)")
    parser.add_argument("--ready-pool", type=int, default=0,
                        help="started sandboxes of the benchmark's shape kept ready (default 0)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every burst")
    args = parser.parse_args(argv)
    if args.rootfs is None:
        from aenv.devserver import base_layer
        args.rootfs = base_layer()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
