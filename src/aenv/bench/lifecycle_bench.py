"""Pause, resume, snapshot and fork of container sandboxes, through the official E2B SDK.

For each workload (idle; 100 MiB resident in a python process; a process appending to a file
continuously) it prints: pause, resume -> ready (the SDK's connect returns once envd
answers), snapshot (total, and the source's pause window as seen from inside the source: the
largest gap in a 1 ms ticker), fork x16 -> all children ready, image size, and host memory per
forked child (the memory charged to its cgroup).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aenv.bench.stats import summarize
from aenv.devserver import ServerProcess, run_with_server

TICKER = r"""nohup python3 -c '
import os, time
last = time.monotonic(); worst = 0.0
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if os.path.exists("/tmp/reset-gap"):
        os.unlink("/tmp/reset-gap"); worst = 0.0; open("/tmp/worst-gap", "w").write("0")
    if now - last > worst:
        worst = now - last
        open("/tmp/worst-gap", "w").write(str(worst))
    last = now
' >/dev/null 2>&1 &"""
WORKLOADS = {
    "idle": "true",
    "100 MiB resident": ("nohup python3 -c 'import time; b = bytearray(100 << 20); "
                         "b[::4096] = b\"x\" * len(b[::4096]); time.sleep(1e9)' >/dev/null 2>&1 &"),
    "writing to disk": ("nohup sh -c 'while true; do head -c 65536 /dev/urandom >> /tmp/grow; "
                        "sleep 0.01; done' >/dev/null 2>&1 &"),
}


def _snapshot_info(snapshot_id: str) -> dict[str, int]:
    import httpx

    url = os.environ["E2B_API_URL"]
    resp = httpx.get(f"{url}/snapshots/{snapshot_id}",
                     headers={"X-API-Key": os.environ["E2B_API_KEY"]})
    resp.raise_for_status()
    return {k: int(v) for k, v in resp.json().items() if k in ("storedBytes", "sizeBytes")}


def _api_pause_resume(sandbox_id: str, rounds: int) -> tuple[list[float], list[float]]:
    """Pause and connect (resume; it answers once envd inside is ready) over one keep-alive
    HTTP client: the server's latency. The SDK's own calls also pay for a new HTTP client
    (TLS context included) each time, ~30-50 ms here."""
    import httpx

    pause: list[float] = []
    resume: list[float] = []
    with httpx.Client(base_url=os.environ["E2B_API_URL"], timeout=60,
                      headers={"X-API-Key": os.environ["E2B_API_KEY"]}) as http:
        for _ in range(rounds):
            t = time.perf_counter()
            http.post(f"/sandboxes/{sandbox_id}/pause").raise_for_status()
            pause.append(time.perf_counter() - t)
            t = time.perf_counter()
            resp = http.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 600})
            resp.raise_for_status()
            resume.append(time.perf_counter() - t)
    return pause, resume


def cgroup_memory(sandbox_id: str) -> int:
    return int(Path(f"/sys/fs/cgroup/memory/aenv/{sandbox_id}/memory.usage_in_bytes").read_text())


def _worst_gap_ms(sbx: object) -> float:
    from e2b import Sandbox

    assert isinstance(sbx, Sandbox)
    return 1000 * float(sbx.files.read("/tmp/worst-gap"))


def run_workload(name: str, command: str, rounds: int = 10) -> list[str]:
    from e2b import Sandbox, SandboxException

    sbx = Sandbox.create(timeout=600)
    sbx.commands.run(command)
    time.sleep(1.5)  # let the workload reach its steady state
    pause: list[float] = []
    resume: list[float] = []
    failures: list[str] = []
    api_pause, api_resume = _api_pause_resume(sbx.sandbox_id, rounds)
    for _ in range(rounds):
        t = time.perf_counter()
        try:
            sbx.pause()
        except SandboxException as exc:  # reported, not fatal: the sandbox stays running
            failures.append(f"pause: {str(exc).splitlines()[0][:100]}")
            time.sleep(1)
            continue
        pause.append(time.perf_counter() - t)
        t = time.perf_counter()
        sbx = Sandbox.connect(sbx.sandbox_id)
        resume.append(time.perf_counter() - t)
    sbx.commands.run(TICKER)
    time.sleep(1.0)
    snap_total: list[float] = []
    windows: list[float] = []
    for _ in range(rounds):
        sbx.files.write("/tmp/reset-gap", "")
        time.sleep(0.3)
        t = time.perf_counter()
        snap = sbx.create_snapshot()
        snap_total.append(time.perf_counter() - t)
        time.sleep(0.3)
        windows.append(_worst_gap_ms(sbx) / 1000)
        Sandbox.delete_snapshot(snap.snapshot_id)
    first, second = sbx.create_snapshot(), sbx.create_snapshot()
    stored = [_snapshot_info(second.snapshot_id)[k] for k in ("storedBytes", "sizeBytes")]
    for snap in (first, second):
        Sandbox.delete_snapshot(snap.snapshot_id)
    # The ticker (a 1 kHz Python loop) is part of measuring the window, not of the workload:
    # sixteen copies of it would load the host while their siblings are still restoring.
    sbx.commands.run("pkill -f 'worst[-]gap' || true")  # [-]: not this shell itself
    fork16: list[float] = []
    per_child_mib = 0.0
    for _ in range(5):
        t = time.perf_counter()
        kids = [k for k in sbx.fork(count=16) if isinstance(k, Sandbox)]
        fork16.append(time.perf_counter() - t)
        time.sleep(1)
        charged = [cgroup_memory(k.sandbox_id) for k in kids]
        per_child_mib = sum(charged) / len(charged) / 2**20 if charged else float("nan")
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: k.kill(), kids))
    sbx.kill()
    return [f"[{name}]",
            summarize("  pause (HTTP API)", api_pause).line(),
            summarize("  resume -> envd ready (HTTP API connect)", api_resume).line(),
            summarize("  pause (SDK)", pause).line(),
            summarize("  resume -> envd ready (SDK connect)", resume).line(),
            summarize("  snapshot, total", snap_total).line(),
            summarize("  snapshot, source pause window (1 ms ticker)", windows).line(),
            summarize("  fork x16 -> all children ready", fork16).line(),
            (f"  {'second snapshot in a row: new bytes stored / size':<50} "
             f"{stored[0] / 2**20:.1f} / {stored[1] / 2**20:.1f} MiB"),
            f"  {'memory per forked child (its cgroup memory.usage)':<50} {per_child_mib:.1f} MiB",
            *(f"  FAILED {f}" for f in failures)]


# A setup that wrote many small files (site-packages, node_modules): `files` of ~4 KiB,
# 100 per directory, in the writable layer. What a fork or a snapshot must capture.
SETUP_FILES = ("python3 -c 'import os, sys\n"
               "n = int(sys.argv[1]); blob = os.urandom(4000)\n"
               "for i in range(n):\n"
               "    d = f\"/home/user/setup/{i // 100}\"\n"
               "    i % 100 or os.makedirs(d)\n"
               "    open(f\"{d}/f{i}.py\", \"wb\").write(blob)\n' N_FILES && sync")
# The parent's freeze as its own processes see it: the largest gap between 5 ms ticks.
TICKER_5MS = TICKER.replace("time.sleep(0.001)", "time.sleep(0.005)")
CAPTURE_SIZES = (1_500, 20_000, 50_000)


_FROZEN_LOG = re.compile(r"snapshot of (\w+): frozen ([\d.]+) ms \(sealing the writable "
                         r"layer ([\d.]+) ms\)")


def _frozen_ms(log: Path, sandbox_id: str) -> tuple[float, float]:
    """The latest capture of `sandbox_id` as the driver logged it: (frozen, sealing) ms."""
    found = [m for m in _FROZEN_LOG.finditer(log.read_text()) if m.group(1) == sandbox_id]
    return (float(found[-1].group(2)), float(found[-1].group(3))) if found else (0.0, 0.0)


def run_capture(server: ServerProcess, files: int, rounds: int = 3) -> list[str]:
    """Fork x16 and create_snapshot() of a sandbox whose setup wrote `files` small files:
    total time and the parent's freeze, as the driver measured it (cgroup frozen -> thawed)
    and as the parent's own ticker saw it (which also counts the CPU the 16 restoring
    children take from it: they weigh 16x while restoring) (issue 16's table)."""
    from e2b import Sandbox

    log = server.log_path or server.home / "server.log"

    sbx = Sandbox.create(timeout=1800)
    try:
        t = time.perf_counter()
        sbx.commands.run(SETUP_FILES.replace("N_FILES", str(files)), timeout=900)
        setup_s = time.perf_counter() - t
        sbx.commands.run(TICKER_5MS)
        time.sleep(1.0)
        fork16: list[float] = []
        fork_frozen: list[float] = []
        fork_ticker: list[float] = []
        snap_total: list[float] = []
        snap_frozen: list[float] = []
        snap_ticker: list[float] = []
        sealing: list[float] = []
        for _ in range(rounds):
            sbx.files.write("/tmp/reset-gap", "")
            time.sleep(0.3)
            t = time.perf_counter()
            kids = [k for k in sbx.fork(count=16) if isinstance(k, Sandbox)]
            fork16.append(time.perf_counter() - t)
            time.sleep(0.3)
            fork_ticker.append(_worst_gap_ms(sbx) / 1000)
            frozen, sealed = _frozen_ms(log, sbx.sandbox_id)
            fork_frozen.append(frozen / 1000)
            sealing.append(sealed / 1000)
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda k: k.kill(), kids))
            sbx.files.write("/tmp/reset-gap", "")
            time.sleep(0.3)
            t = time.perf_counter()
            snap = sbx.create_snapshot()
            snap_total.append(time.perf_counter() - t)
            time.sleep(0.3)
            snap_ticker.append(_worst_gap_ms(sbx) / 1000)
            frozen, sealed = _frozen_ms(log, sbx.sandbox_id)
            snap_frozen.append(frozen / 1000)
            sealing.append(sealed / 1000)
            Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        sbx.kill()
    return [f"[setup wrote {files} files of 4 KB in {setup_s:.1f} s]",
            summarize("  fork x16 -> all children ready", fork16).line(),
            summarize("  fork x16, parent frozen (driver)", fork_frozen).line(),
            summarize("  fork x16, parent's longest gap (5 ms ticker)", fork_ticker).line(),
            summarize("  create_snapshot(), total", snap_total).line(),
            summarize("  create_snapshot(), parent frozen (driver)", snap_frozen).line(),
            summarize("  create_snapshot(), parent's longest gap", snap_ticker).line(),
            summarize("  sealing the writable layer (in the freeze)", sealing).line()]


def storage_cost(rounds: int = 15) -> int:
    """Create, pause and resume on an ext4 home with the managed btrfs volume (the default)
    and without it (`storage.volume = "off"`), two servers side by side, interleaved."""
    import httpx

    from aenv.devserver import prepare_home, remove_home

    saved = os.environ.get("AENV_TEST_FS")
    os.environ["AENV_TEST_FS"] = "ext4"  # both homes on the host's filesystem
    try:
        servers = {name: ServerProcess(home=prepare_home(f"aenv-storage-bench-{name}-"),
                                       api_key="bench-key", extra_env=env)
                   for name, env in (("volume", {}),
                                     ("off", {"AENV_STORAGE_VOLUME": "off"}))}
    finally:
        if saved is None:
            os.environ.pop("AENV_TEST_FS", None)
        else:
            os.environ["AENV_TEST_FS"] = saved
    times: dict[str, dict[str, list[float]]] = {n: {"create": [], "pause": [], "resume": []}
                                                for n in servers}
    try:
        clients = {}
        for name, srv in servers.items():
            srv.start(ready_timeout=300)
            clients[name] = httpx.Client(base_url=srv.url, timeout=120,
                                         headers={"X-API-Key": srv.api_key})
        for _ in range(rounds):
            for name, http in clients.items():
                t = time.perf_counter()
                resp = http.post("/sandboxes", json={"templateID": "base", "timeout": 600})
                resp.raise_for_status()
                times[name]["create"].append(time.perf_counter() - t)
                sid = resp.json()["sandboxID"]
                http.post(f"/sandboxes/{sid}/pause").raise_for_status()  # warm-up round
                http.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).raise_for_status()
                t = time.perf_counter()
                http.post(f"/sandboxes/{sid}/pause").raise_for_status()
                times[name]["pause"].append(time.perf_counter() - t)
                t = time.perf_counter()
                http.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).raise_for_status()
                times[name]["resume"].append(time.perf_counter() - t)
                http.delete(f"/sandboxes/{sid}")
        print("ext4 home: managed btrfs volume vs storage.volume=off, interleaved:")
        for op in ("create", "pause", "resume"):
            for name in servers:
                print("  " + summarize(f"{op} ({name})", times[name][op]).line(), flush=True)
    finally:
        for srv in servers.values():
            srv.shutdown()
            remove_home(srv.home)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m aenv.bench.lifecycle_bench [files|storage]`: the workloads above, or
    (`files`) capture of setups of CAPTURE_SIZES small files, or (`storage`) what the managed
    volume costs create, pause and resume."""
    args = [] if argv is None else argv
    if args[:1] == ["storage"]:
        return storage_cost()
    if args[:1] == ["files"]:
        def captures(server: ServerProcess) -> Iterator[str]:
            yield f"home {server.home}: {_storage_kind(server.home)}"
            for n in CAPTURE_SIZES:
                yield from run_capture(server, n)

        return run_with_server("aenv-capture-bench-", "container runtime: fork and snapshot "
                               "capture of many-file setups, through the e2b SDK 2.63:",
                               captures)

    def all_workloads(_: ServerProcess) -> Iterator[str]:
        for name, command in WORKLOADS.items():
            yield from run_workload(name, command)

    return run_with_server("aenv-lifecycle-bench-", "container runtime: pause / resume / "
                           "snapshot / fork, through the e2b SDK 2.63:", all_workloads)


def _storage_kind(home: Path) -> str:
    """Where the sandboxes' writable layers are: the managed volume, or the home's own fs."""
    import subprocess

    out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,TARGET", "-T",
                          str((home / "sandboxes").resolve())],
                         capture_output=True, text=True, check=False).stdout.strip()
    return f"sandboxes on {out.splitlines()[0] if out else '?'}"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
