"""Pause, resume, snapshot and fork of container sandboxes, through the official E2B SDK.

For each workload (idle; 100 MiB resident in a python process; a process appending to a file
continuously) it prints: pause, resume -> ready (the SDK's connect returns once envd
answers), snapshot (total, and the source's pause window as seen from inside the source: the
largest gap in a 1 ms ticker), fork x16 -> all children ready, image size, and host memory per
forked child (the memory charged to its cgroup).
"""

from __future__ import annotations

import os
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


def main() -> int:
    def all_workloads(_: ServerProcess) -> Iterator[str]:
        for name, command in WORKLOADS.items():
            yield from run_workload(name, command)

    return run_with_server("aenv-lifecycle-bench-", "container runtime: pause / resume / "
                           "snapshot / fork, through the e2b SDK 2.63:", all_workloads)


if __name__ == "__main__":
    raise SystemExit(main())
