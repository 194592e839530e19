"""qemu (microVM) runtime lifecycle benchmark, below the API: `QemuDriver` used directly.

Prints, with the accelerator in use (kvm, or tcg = software emulation):
- cold boot -> envd ready, and create -> envd ready (a restore of the shape's boot
  snapshot, what `create()` does by default);
- pause (stop + migrate everything into the workspace + quit), resume -> envd ready;
- snapshot: the window the source VM is stopped;
- fork x4 and x16: concurrent restores of one snapshot -> all children's envd ready;
- host memory per forked child (PSS of its QEMU process: the snapshot's RAM pages are shared
  copy-on-write, so each child's share of them is split);
- balloon free-page reporting: the QEMU process' RSS idle, with 256 MiB allocated in the
  guest, and after the guest freed it.

Usage (root): python -m aenv.bench.vm_bench [--rounds 3] [--memory 512]
Owns: nothing but its temporary AENV home and the VMs it makes (all destroyed).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import string
import tempfile
import time
from pathlib import Path

from aenv.bench.stats import summarize
from aenv.config import Config
from aenv.devserver import base_layer, layer_cache
from aenv.runtime.base import RuntimeHandle, SandboxSpec
from aenv.runtime.qemu.driver import QemuDriver

TOKEN = "bench-token"


def _id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(20))


class VmBench:
    def __init__(self, home: Path, rootfs: Path, memory_mb: int) -> None:
        cfg = Config()
        cfg.server.home = home
        cfg.runtime.warm_pool = 2
        self.home = home
        self.rootfs = rootfs
        self.memory_mb = memory_mb
        self.driver = QemuDriver(cfg, disk_cache=layer_cache().parent / "vm-disks")
        self.made: list[RuntimeHandle] = []

    def spec(self, sid: str | None = None) -> SandboxSpec:
        sid = sid or _id()
        return SandboxSpec(sandbox_id=sid, lower_layers=(self.rootfs,),
                           workspace=self.home / "sandboxes" / sid, cpu_count=1,
                           memory_mb=self.memory_mb, pids_max=1024, default_user="root",
                           envd_access_token=TOKEN, allow_internet_access=False)

    async def create(self, cold: bool = False) -> RuntimeHandle:
        spec = self.spec()
        handle = await (self.driver._boot(spec) if cold else self.driver.create(spec))
        self.made.append(handle)
        return handle

    async def exec(self, handle: RuntimeHandle, cmd: str) -> None:
        """Start `cmd` through envd (fire and forget: the stream is read to its end)."""
        import base64
        import json

        message = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}}).encode()
        frame = bytes([0]) + len(message).to_bytes(4, "big") + message
        auth = base64.b64encode(b"root:").decode()
        sock = await self.driver.connect(handle, 49983)
        reader, writer = await asyncio.open_connection(sock=sock)
        head = ("POST /process.Process/Start HTTP/1.1\r\nHost: s\r\nConnection: close\r\n"
                "Content-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n"
                f"Authorization: Basic {auth}\r\nX-Access-Token: {TOKEN}\r\n"
                f"Content-Length: {len(frame)}\r\n\r\n")
        writer.write(head.encode() + frame)
        await writer.drain()
        await asyncio.wait_for(reader.read(), 300)
        writer.close()

    async def destroy_all(self) -> None:
        for handle in self.made:
            await self.driver.destroy(handle)
        self.made.clear()


async def _run(rounds: int, memory_mb: int) -> list[str]:
    home = Path(tempfile.mkdtemp(prefix="aenv-vm-bench-"))
    bench = VmBench(home, base_layer(), memory_mb)
    drv = bench.driver
    out: list[str] = []
    try:
        t = time.perf_counter()
        await drv.start()
        out.append(f"accelerator: {drv.accel} ({drv.accel_reason}); driver start "
                   f"{time.perf_counter() - t:.2f} s; guest RAM {memory_mb} MiB")
        await drv.root_images.get((bench.rootfs,))  # built once, not part of a boot
        boots: list[float] = []
        creates: list[float] = []
        pauses: list[float] = []
        resumes: list[float] = []
        restores: list[float] = []  # resume -> vCPUs running again (before envd answers)
        windows: list[float] = []
        for _ in range(rounds):
            t = time.perf_counter()
            await bench.create(cold=True)
            boots.append(time.perf_counter() - t)
        out.append(summarize("cold boot -> envd ready", boots).line())
        t = time.perf_counter()
        await drv._boot_image(bench.spec())
        out.append(f"boot snapshot of the shape made once in {time.perf_counter() - t:.2f} s")
        for _ in range(rounds):
            t = time.perf_counter()
            await bench.create()
            creates.append(time.perf_counter() - t)
        out.append(summarize("create (boot snapshot restored) -> envd ready", creates).line())
        for handle in bench.made[1:]:
            await drv.destroy(handle)
        del bench.made[1:]
        handle = bench.made[0]
        await bench.exec(handle, "nohup sleep 100000 >/dev/null 2>&1 &")
        for _ in range(rounds):
            t = time.perf_counter()
            paused = await drv.pause(handle)
            pauses.append(time.perf_counter() - t)
            t = time.perf_counter()
            handle = await drv.resume(paused, bench.spec(paused.sandbox_id))
            resumes.append(time.perf_counter() - t)
            restores.append(drv.running_since(handle) - t)
            bench.made[0] = handle
        out.append(summarize("pause (migrate to file + quit)", pauses).line())
        out.append(summarize("resume -> restored and running", restores).line())
        out.append(summarize("resume -> envd ready", resumes).line())
        images = home / "images"
        for i in range(rounds):
            shutil.rmtree(images, ignore_errors=True)
            timings = await drv.snapshot(handle, images)
            windows.append(timings["frozen_s"])
            if i == 0:
                out.append(f"snapshot image: {timings['image_bytes'] / 2**20:.0f} MiB on disk")
        out.append(summarize("snapshot: source stopped for", windows).line())
        for count in (4, 16):
            t = time.perf_counter()
            kids = await asyncio.gather(*[drv.restore(bench.spec(), images, TOKEN)
                                          for _ in range(count)])
            elapsed = time.perf_counter() - t
            # The same clock: perf_counter and monotonic are both CLOCK_MONOTONIC on Linux.
            running = max(drv.running_since(k) for k in kids) - t
            bench.made.extend(kids)
            await asyncio.sleep(2)
            pss = [(await drv.memory(k)).get("Pss", 0) for k in kids]
            out.append(f"fork x{count:<2} -> all restored and running: {running:.2f} s, "
                       f"all envd ready: {elapsed:.2f} s; PSS per child "
                       f"{sum(pss) / len(pss) / 2**20:.1f} MiB")
            for kid in kids:
                await drv.destroy(kid)
                bench.made.remove(kid)
        # Balloon: allocate and free 256 MiB in the guest; free-page reporting returns it.
        fresh = await bench.create()
        await asyncio.sleep(3)
        idle = (await drv.memory(fresh))["Rss"]
        await bench.exec(fresh, "python3 -c \"b = bytearray(256 << 20); "
                         "[b.__setitem__(i, 1) for i in range(0, len(b), 4096)]\"")
        peak = (await drv.memory(fresh))["Rss"]
        t = time.perf_counter()
        now = peak
        while time.perf_counter() - t < 30:
            await asyncio.sleep(0.5)
            now = (await drv.memory(fresh))["Rss"]
            if now < idle + 64 * 2**20:
                break
        out.append(f"balloon: QEMU RSS idle {idle / 2**20:.0f} MiB, with 256 MiB used "
                   f"{peak / 2**20:.0f} MiB, {time.perf_counter() - t:.1f} s after free "
                   f"{now / 2**20:.0f} MiB")
    finally:
        await bench.destroy_all()
        await drv.close()
        shutil.rmtree(home, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.bench.vm_bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", type=int, default=512, help="guest RAM, MiB")
    args = parser.parse_args(argv)
    print("qemu microVM runtime (driver level)")
    for line in asyncio.run(_run(args.rounds, args.memory)):
        print("  " + line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
