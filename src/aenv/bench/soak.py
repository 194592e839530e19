"""`make soak`: a bounded soak of one aenv server under `kill -9`, through the official E2B SDK.

    python -m aenv.bench.soak --minutes N [--sandboxes K] [--kill-every S]
                              [--kill-mode anywhere|between] [--files F] [--json PATH]

Owns: the soak's own server (a fresh home from `devserver.prepare_home`, a `ServerProcess` on a
loopback port), its workers and its report. Each of K workers cycles create -> write F files of
random sizes (sha256 of each recorded) -> verify -> pause -> resume -> verify -> fork x2..4 ->
verify in every child -> snapshot -> create from the snapshot -> verify -> kill. A killer thread
sends the server SIGKILL every `--kill-every` seconds (`anywhere`: whatever is in flight;
`between`: once no SDK call is in flight) and restarts it on the same home and port. SDK calls
cut by a crash are retried and counted as interrupted, not as errors.

At the end: every surviving sandbox's and kept snapshot's files are verified again, every listed
snapshot is started once, everything is killed and deleted, the server is stopped, and the host
is searched for what is left of the run's sandboxes (mounts under the home, cgroups and their
processes, network slots and veths, workspaces, sealed layers, snapshot files).

Invariants (exit status 0 only if all hold): no 5xx answer, no committed file lost, nothing
leaked. Printed as a table; `--json PATH` writes the whole report.

Must not touch: anything but its own home, server and sandboxes (other servers may share the
host: leaks are looked for only among resources this run's servers made). Loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from aenv.bench.stats import percentile
from aenv.devserver import ServerProcess, free_port, prepare_home, remove_home

T = TypeVar("T")

DATA_DIR = "/home/user/soak"
SANDBOX_TTL = 900  # seconds: no sandbox of a cycle expires under it
MAX_ATTEMPTS = 6  # per operation, interruptions included
MAX_FAILED_CYCLES = 10  # in a row: then the worker stops (each failure may leave a sandbox)
RESTART_TIMEOUT = 300.0
OP_TIMEOUT = 120.0  # the SDK's request timeout for every call
ID_RE = re.compile(r"\b[a-z0-9]{20}\b")
FIVE_XX_RE = re.compile(r"Response (5\d\d)\b")


# ----------------------------------------------------------------------------- bookkeeping


@dataclass
class OpStats:
    done: int = 0
    interrupted: int = 0
    errors: int = 0
    seconds: list[float] = field(default_factory=list)


class Report:
    """Everything the workers count; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: dict[str, OpStats] = {}
        self.errors: list[dict[str, Any]] = []
        self.five_xx: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any]] = []
        self.unusable_snapshots: list[dict[str, Any]] = []
        self.files_written = 0
        self.files_verified = 0
        self.files_lost = 0
        self.cycles = 0
        self.kills: list[dict[str, Any]] = []
        self.sandbox_ids: set[str] = set()

    def op(self, name: str) -> OpStats:
        with self.lock:
            return self.ops.setdefault(name, OpStats())

    def add(self, attr: str, value: Any) -> None:
        with self.lock:
            target = getattr(self, attr)
            if isinstance(target, list):
                if len(target) < 500:
                    target.append(value)
            elif isinstance(target, set):
                target.add(value)
            else:
                setattr(self, attr, target + value)


@dataclass
class Tracked:
    """A sandbox or snapshot and the files it must hold (name -> sha256)."""

    id: str
    files: dict[str, str]
    worker: int
    history: list[str] = field(default_factory=list)  # operations done on it, last last


class Interrupted(Exception):
    """An operation cut by a server crash (retried by the caller's policy)."""


class OpFailed(Exception):
    """An operation that failed while the server was up: an error of the run."""


class Lost(Exception):
    """A sandbox or snapshot with committed files is gone."""


# ----------------------------------------------------------------------------- the server


class ServerControl:
    """The soak's server: started, `kill -9`ed and restarted on the same home and port."""

    def __init__(self, home: Path, report: Report) -> None:
        self.home = home
        self.port = free_port()
        self.api_key = "aenv_soak_key"
        self.report = report
        self.server: ServerProcess | None = None
        self.up = threading.Event()
        self.epoch = 0  # kills so far: an operation that saw it change was interrupted
        self.pids: list[int] = []
        self.lock = threading.Lock()
        self.dead = False  # a restart failed: the run is over
        self.t0 = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        started = time.monotonic()
        self.server = ServerProcess(home=self.home, port=self.port, api_key=self.api_key)
        try:
            self.server.start(ready_timeout=RESTART_TIMEOUT)
        except (RuntimeError, TimeoutError) as exc:
            log = self.home / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{exc}\n--- end of server.log ---\n{tail}") from None
        assert self.server.proc is not None
        self.pids.append(self.server.proc.pid)
        self.up.set()
        return time.monotonic() - started

    def kill_and_restart(self, mode: str) -> None:
        with self.lock:
            assert self.server is not None
            self.up.clear()
            self.epoch += 1
            killed_at = time.monotonic()
            self.server.stop(signal.SIGKILL)
            down = time.monotonic()
            restart = self.start()
            self.report.add("kills", {"mode": mode, "at_s": round(killed_at - self.t0, 1),
                                      "restart_s": round(restart + down - killed_at, 3)})

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.up.clear()

    def wait_up(self, timeout: float = RESTART_TIMEOUT) -> None:
        if self.dead:
            raise OpFailed("the server did not restart")
        if not self.up.wait(timeout):
            raise OpFailed(f"server not back after {timeout:.0f} s")

    def opts(self) -> dict[str, Any]:
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url,
                "request_timeout": OP_TIMEOUT}

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key}, timeout=OP_TIMEOUT)


class Gate:
    """`between` kills: the killer closes the gate and waits until no operation is in flight."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.closed = False
        self.busy = 0

    @contextlib.contextmanager
    def passage(self) -> Iterator[None]:
        with self.cond:
            while self.closed:
                self.cond.wait()
            self.busy += 1
        try:
            yield
        finally:
            with self.cond:
                self.busy -= 1
                self.cond.notify_all()

    def close(self, timeout: float) -> bool:
        with self.cond:
            self.closed = True
            return self.cond.wait_for(lambda: self.busy == 0, timeout)

    def open(self) -> None:
        with self.cond:
            self.closed = False
            self.cond.notify_all()


class FiveXXLog(logging.Handler):
    """The SDK's request/response log (its `logger=` option): every 5xx it received."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(logging.INFO)
        self.worker = worker
        self.last_request = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Request "):
            self.last_request = message[len("Request "):]
            return
        match = FIVE_XX_RE.match(message)
        if match:
            self.worker.saw_5xx(int(match.group(1)), self.last_request)


# ----------------------------------------------------------------------------- a worker


class Worker(threading.Thread):
    """One sandbox at a time through the cycle; what it made and must survive is in `live`
    (sandboxes) and `snapshots` (the last one it keeps)."""

    def __init__(self, index: int, ctl: ServerControl, gate: Gate, report: Report, deadline: float,
                 files: int, seed: int) -> None:
        super().__init__(name=f"soak-worker-{index}", daemon=True)
        self.index = index
        self.ctl = ctl
        self.gate = gate
        self.report = report
        self.deadline = deadline
        self.n_files = files
        self.rng = random.Random(seed)
        self.current_op = ""
        self.logger = logging.getLogger(f"aenv.soak.worker{index}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.logger.addHandler(FiveXXLog(self))
        self.live: dict[str, Tracked] = {}  # sandboxes of this worker that must survive
        self.snapshots: list[Tracked] = []  # the snapshot(s) this worker keeps
        self.seen_5xx_in_attempt = False

    # -- plumbing -----------------------------------------------------------------------

    def saw_5xx(self, status: int, request: str) -> None:
        self.seen_5xx_in_attempt = True
        self.report.add("five_xx", {"op": self.current_op, "status": status, "request": request,
                                    "worker": self.index, "interrupted_window": not self.ctl.up.is_set()})

    def sdk(self) -> dict[str, Any]:
        return {**self.ctl.opts(), "logger": self.logger}

    def call(self, name: str, fn: Callable[[], T], retry: bool = True) -> T:
        """Run one SDK operation. Cut by a crash: retried (`retry`) or Interrupted raised.
        Failed with the server up: OpFailed (or Lost, for a 404 of something committed)."""
        from e2b import NotFoundException
        from e2b.exceptions import SandboxNotRunningException

        stats = self.report.op(name)
        for _ in range(MAX_ATTEMPTS):
            self.ctl.wait_up()
            with self.gate.passage():
                epoch, was_up = self.ctl.epoch, self.ctl.up.is_set()
                self.current_op, self.seen_5xx_in_attempt = name, False
                started = time.monotonic()
                try:
                    result = fn()
                except Exception as exc:  # classified below
                    if self.ctl.epoch != epoch or not was_up or not self.ctl.up.is_set():
                        with self.report.lock:
                            stats.interrupted += 1
                        if not retry:
                            raise Interrupted(name) from exc
                        continue
                    status = getattr(exc, "status_code", None)
                    if isinstance(status, int) and status >= 500 and not self.seen_5xx_in_attempt:
                        self.saw_5xx(status, f"(from the exception) {type(exc).__name__}")
                    # gone: the API's 404, or the proxy's "not running" for envd traffic
                    if isinstance(exc, (NotFoundException, SandboxNotRunningException)):
                        raise Lost(f"{name}: {type(exc).__name__}: {exc}") from exc
                    with self.report.lock:
                        stats.errors += 1
                    self.report.add("errors", {"op": name, "worker": self.index,
                                               "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                    raise OpFailed(f"{name}: {type(exc).__name__}: {exc}") from exc
                with self.report.lock:
                    stats.done += 1
                    stats.seconds.append(time.monotonic() - started)
                return result
        self.report.add("errors", {"op": name, "worker": self.index, "error": "too many interruptions"})
        raise OpFailed(f"{name}: interrupted {MAX_ATTEMPTS} times")

    # -- files ----------------------------------------------------------------------------

    def make_files(self) -> dict[str, bytes]:
        files = {}
        for i in range(self.n_files):
            roll = self.rng.random()
            size = (self.rng.randint(0, 4096) if roll < 0.7 else
                    self.rng.randint(4096, 65536) if roll < 0.95 else self.rng.randint(65536, 512 << 10))
            files[f"f{i:04d}.bin"] = self.rng.randbytes(size)
        return files

    def checksums(self, sbx: Any) -> dict[str, str]:
        from e2b import CommandExitException

        try:
            out = sbx.commands.run(f"cd {DATA_DIR} && sha256sum -- *", timeout=60,
                                   request_timeout=OP_TIMEOUT).stdout
        except CommandExitException as exc:  # a missing file: the others still count
            out = exc.stdout
        sums = {}
        for line in out.splitlines():
            digest, _, name = line.partition("  ")
            sums[name.strip()] = digest.strip()
        return sums

    def verify(self, name: str, sbx: Any, tracked: Tracked) -> None:
        sums = self.call(name, lambda: self.checksums(sbx))
        bad = sorted(n for n, digest in tracked.files.items() if sums.get(n) != digest)
        self.report.add("files_verified", len(tracked.files) - len(bad))
        if bad:
            self.report.add("files_lost", len(bad))
            self.report.add("lost", {"what": "files", "id": sbx.sandbox_id, "op": name,
                                     "files": len(bad), "first": bad[:5], "history": tracked.history[-6:],
                                     "kills_so_far": self.ctl.epoch})
        tracked.history.append(name)

    def lost(self, tracked: Tracked, why: str) -> None:
        self.report.add("files_lost", len(tracked.files))
        self.report.add("lost", {"what": "sandbox or snapshot", "id": tracked.id, "why": why,
                                 "files": len(tracked.files), "history": tracked.history[-6:],
                                 "kills_so_far": self.ctl.epoch})

    # -- operations -----------------------------------------------------------------------

    def create(self, template: str | None = None) -> Any:
        from e2b import Sandbox

        sbx = self.call("create" if template is None else "create_from_snapshot",
                        lambda: Sandbox.create(template, timeout=SANDBOX_TTL,
                                               metadata={"aenv-soak": str(self.index)}, **self.sdk()))
        self.report.add("sandbox_ids", sbx.sandbox_id)
        return sbx

    def pause(self, sbx: Any, tracked: Tracked) -> None:
        """Pause; after a crash in the middle, whatever the server made of it must be usable:
        paused (done) or running (paused again)."""
        from e2b import Sandbox, SandboxState

        for _ in range(MAX_ATTEMPTS):
            try:
                self.call("pause", lambda: sbx.pause(request_timeout=OP_TIMEOUT), retry=False)
                tracked.history.append("pause")
                return
            except Interrupted:
                tracked.history.append("pause (interrupted)")
                info = self.call("get_info", lambda: Sandbox.get_info(sbx.sandbox_id, **self.ctl.opts()))
                if info.state == SandboxState.PAUSED:
                    return
        raise OpFailed("pause: interrupted too often")

    def resume(self, tracked: Tracked) -> Any:
        from e2b import Sandbox

        sbx = self.call("resume", lambda: Sandbox.connect(tracked.id, timeout=SANDBOX_TTL, **self.sdk()))
        tracked.history.append("resume")
        return sbx

    def kill(self, sbx: Any) -> None:
        # False (not found) after a retry: the interrupted attempt had killed it
        self.call("kill", lambda: _gone_ok(lambda: sbx.kill(request_timeout=OP_TIMEOUT)))
        self.live.pop(sbx.sandbox_id, None)

    def delete_snapshot(self, snap: Tracked) -> None:
        from e2b import Sandbox

        self.call("delete_snapshot",
                  lambda: _gone_ok(lambda: Sandbox.delete_snapshot(snap.id, **self.ctl.opts())))

    def cycle(self) -> None:
        files = self.make_files()
        sbx = self.create()
        tracked = Tracked(sbx.sandbox_id, {}, self.index, ["create"])
        self.live[sbx.sandbox_id] = tracked
        try:
            from e2b.sandbox.filesystem.filesystem import WriteEntry

            entries = [WriteEntry(path=f"{DATA_DIR}/{n}", data=d) for n, d in files.items()]
            self.call("write_files", lambda: sbx.files.write_files(entries, request_timeout=OP_TIMEOUT))
            tracked.files = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
            tracked.history.append("write_files")
            self.report.add("files_written", len(files))
            self.verify("verify_written", sbx, tracked)
            if self.past_deadline():
                return
            self.pause(sbx, tracked)
            sbx = self.resume(tracked)
            self.verify("verify_resumed", sbx, tracked)
            count = self.rng.randint(2, 4)
            children = self.call("fork", lambda: sbx.fork(count=count, timeout=SANDBOX_TTL,
                                                          request_timeout=OP_TIMEOUT))
            tracked.history.append(f"fork x{count}")
            for child in children:
                if isinstance(child, Exception):
                    self.report.add("errors", {"op": "fork_child", "worker": self.index,
                                               "error": f"{type(child).__name__}: {str(child)[:300]}"})
                    continue
                self.report.add("sandbox_ids", child.sandbox_id)
                self.verify_other("verify_fork_child", child, tracked.files)
            snap_info = self.call("snapshot", lambda: sbx.create_snapshot(request_timeout=OP_TIMEOUT))
            tracked.history.append("snapshot")
            snap = Tracked(snap_info.snapshot_id, dict(tracked.files), self.index, ["snapshot"])
            self.snapshots.append(snap)
            try:
                copy = self.create(snap.id)
            except Lost as exc:  # the snapshot, not the sandbox
                self.lost(snap, str(exc))
                self.snapshots.remove(snap)
                raise OpFailed(str(exc)) from exc
            self.verify_other("verify_snapshot_copy", copy, snap.files)
            while len(self.snapshots) > 1:
                self.delete_snapshot(self.snapshots.pop(0))
            tracked.history.append("kill")
            self.kill(sbx)
        except Lost as exc:
            self.lost(tracked, str(exc))
            self.live.pop(tracked.id, None)
            raise

    def verify_other(self, name: str, sbx: Any, files: dict[str, str]) -> None:
        """Verify a fork child or a snapshot's copy (it holds `files` too), then kill it. One
        that is gone is lost on its own: its parent's cycle goes on."""
        other = Tracked(sbx.sandbox_id, files, self.index, [name.removeprefix("verify_")])
        try:
            self.verify(name, sbx, other)
        except Lost as exc:
            self.lost(other, str(exc))
            return
        self.kill(sbx)

    def past_deadline(self) -> bool:
        return time.monotonic() >= self.deadline

    def run(self) -> None:
        failures = 0  # in a row
        while not self.past_deadline() and not self.ctl.dead:
            try:
                self.cycle()
                self.report.add("cycles", 1)
                failures = 0
                continue
            except (OpFailed, Lost) as exc:
                logging.getLogger("aenv.soak").warning("worker %d: %s", self.index, exc)
                # the cycle's main sandbox is left to the final checks and cleanup
            except Exception as exc:  # noqa: BLE001 - a worker never dies silently
                self.report.add("errors", {"op": "worker", "worker": self.index,
                                           "error": f"{type(exc).__name__}: {exc}"})
            failures += 1
            if failures >= MAX_FAILED_CYCLES:
                self.report.add("errors", {"op": "worker", "worker": self.index,
                                           "error": f"stopped after {failures} failed cycles in a row"})
                return
            time.sleep(min(30.0, 2.0 * failures))  # a broken server is not hammered


# ----------------------------------------------------------------------------- the killer


def killer(ctl: ServerControl, gate: Gate, mode: str, every: float, deadline: float,
           stop: threading.Event, rng: random.Random) -> None:
    next_kill = time.monotonic() + every * (rng.uniform(0.5, 1.0) if mode == "anywhere" else 1.0)
    while not stop.is_set():
        if time.monotonic() >= next_kill:
            if time.monotonic() >= deadline - 5:
                return  # no restart racing the end of the run
            if mode == "between":
                drained = gate.close(timeout=OP_TIMEOUT * 2)
                if not drained:
                    ctl.report.add("errors", {"op": "killer", "worker": -1,
                                              "error": "operations still in flight at a between-kill"})
            try:
                ctl.kill_and_restart(mode)
            except RuntimeError as exc:
                ctl.dead = True
                ctl.report.add("errors", {"op": "restart", "worker": -1, "error": str(exc)[:3000]})
                return
            finally:
                gate.open()
            next_kill = time.monotonic() + every * (rng.uniform(0.5, 1.5) if mode == "anywhere" else 1.0)
        stop.wait(0.1)


# ----------------------------------------------------------------------------- the host


def cgroup_names() -> set[str]:
    from aenv.runtime.container.cgroups import CgroupLayout

    base = CgroupLayout().path("pids", "x").parent
    return {p.name for p in base.iterdir() if p.is_dir()} if base.is_dir() else set()


def mounts_under(home: Path) -> set[str]:
    prefix = str(home.resolve())
    found = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.add(point)
    return found


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@dataclass
class Baseline:
    cgroups: set[str]
    mounts: set[str]
    netns: set[str]


def sandbox_ids_of_run(ctl: ServerControl, report: Report, baseline: Baseline) -> set[str]:
    """Every sandbox id this run may have made: those the API returned, workspaces seen, and
    cgroups new since the start whose name the run's server log mentions."""
    from aenv.storage.layout import Layout

    ids = set(report.sandbox_ids)
    workspaces = Layout(ctl.home).sandboxes_dir
    if workspaces.is_dir():
        ids |= {p.name for p in workspaces.iterdir()}
    log = ctl.home / "server.log"
    mentioned = set(ID_RE.findall(log.read_text(errors="replace"))) if log.exists() else set()
    ids |= (cgroup_names() - baseline.cgroups) & mentioned
    return ids


def leaks(ctl: ServerControl, report: Report, baseline: Baseline) -> dict[str, list[str]]:
    """What is left of the run once every sandbox was killed and the server stopped."""
    from aenv.runtime.container.cgroups import CONTROLLERS, CgroupLayout
    from aenv.runtime.container.network import NETNS_DIR, VETH_PREFIX
    from aenv.storage.layout import Layout

    layout, cgroups = Layout(ctl.home), CgroupLayout()
    ids = sandbox_ids_of_run(ctl, report, baseline)
    found: dict[str, list[str]] = {}
    found["mounts"] = sorted(mounts_under(ctl.home) - baseline.mounts)
    found["cgroups"] = sorted(f"{c}/{i}" for i in ids for c in CONTROLLERS if cgroups.path(c, i).exists())
    found["processes"] = sorted(f"{pid} (sandbox {i})" for i in ids for pid in cgroups.pids(i))
    owners = {str(pid) for pid in ctl.pids}
    slots = [p.name for p in NETNS_DIR.glob("s*.*") if p.name.partition(".")[2] in owners] \
        if NETNS_DIR.is_dir() else []
    found["network_slots"] = sorted(slots)
    veths = {f"{VETH_PREFIX}{name[1:].partition('.')[0]}" for name in slots}
    found["veths"] = sorted(v for v in veths if Path(f"/sys/class/net/{v}").exists())
    found["workspaces"] = sorted(p.name for p in layout.sandboxes_dir.iterdir()) \
        if layout.sandboxes_dir.is_dir() else []
    found["sealed_layers"] = sorted(p.name for p in layout.layers_dir.glob("seal-*"))
    snapshots = ctl.home / "cache" / "snapshots"
    found["snapshot_files"] = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    return found


def repository_state(home: Path) -> dict[str, int]:
    """The snapshot repository (posix_fs under the home) at the end: deferred garbage, not a
    leak by itself (its `gc` removes unreferenced chunks, stale markers and partial uploads),
    but what a crash leaves there until then."""
    root = home / "repository"
    blobs = [p for p in (root / "blobs").rglob("*") if p.is_file()] if (root / "blobs").is_dir() else []
    def count(sub: str) -> int:
        path = root / sub
        return sum(1 for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
    return {"manifests": count("meta/manifests"), "pending_markers": count("meta/pending"),
            "partial_uploads": count("tmp"), "blobs": len(blobs),
            "blob_bytes": sum(p.stat().st_size for p in blobs)}


# ----------------------------------------------------------------------------- final phase


def _gone_ok(fn: Callable[[], object]) -> None:
    from e2b import NotFoundException

    with contextlib.suppress(NotFoundException):
        fn()


def list_all(ctl: ServerControl, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    with ctl.http() as http:
        token: str | None = None
        for _ in range(100):
            query = dict(params, **({"nextToken": token} if token else {}))
            resp = http.get(path, params=query)
            if resp.status_code >= 500:
                ctl.report.add("five_xx", {"op": f"GET {path}", "status": resp.status_code,
                                           "request": str(resp.url), "worker": -1,
                                           "interrupted_window": False})
            resp.raise_for_status()
            items += resp.json()
            token = resp.headers.get("x-next-token")
            if not token:
                return items
    return items


def final_checks(ctl: ServerControl, report: Report, workers: list[Worker], files: int) -> None:
    """Verify what must have survived; start every listed snapshot once."""
    final = Worker(-1, ctl, Gate(), report, time.monotonic() + 3600, files, 0)
    ctl.wait_up()
    for worker in workers:
        for tracked in list(worker.live.values()):
            if not tracked.files:
                continue  # killed before its files were committed: nothing to lose
            try:
                sbx = final.resume(tracked)
                final.verify("final_verify_sandbox", sbx, tracked)
            except Lost as exc:
                if tracked.history[-1:] == ["kill"]:  # its kill failed, yet it went: no loss
                    report.add("errors", {"op": "final_verify_sandbox", "worker": -1,
                                          "error": f"{tracked.id}: gone after a failed kill"})
                    continue
                final.lost(tracked, f"at the end: {exc}")
            except OpFailed as exc:
                report.add("errors", {"op": "final_verify_sandbox", "worker": -1, "error": str(exc)})
        for snap in worker.snapshots:
            try:
                copy = final.create(snap.id)
                final.verify("final_verify_snapshot", copy, Tracked(copy.sandbox_id, snap.files, -1))
                final.kill(copy)
            except Lost as exc:
                final.lost(snap, f"snapshot at the end: {exc}")
            except OpFailed as exc:
                report.add("errors", {"op": "final_verify_snapshot", "worker": -1, "error": str(exc)})
    kept = {s.id for w in workers for s in w.snapshots}
    for item in list_all(ctl, "/snapshots", {"limit": "100"}):
        snapshot_id = str(item.get("snapshotID") or item.get("snapshotId") or "")
        if not snapshot_id or snapshot_id in kept:
            continue
        try:  # a snapshot listed but made by an operation a crash cut: it must still work
            copy = final.create(snapshot_id)
            final.call("final_start_listed_snapshot", functools.partial(copy.commands.run, "true", timeout=30))
            final.kill(copy)
        except (Lost, OpFailed) as exc:
            report.add("unusable_snapshots", {"id": snapshot_id, "names": item.get("names"),
                                              "error": str(exc)[:300]})


def remove_everything(ctl: ServerControl) -> None:
    """Kill every sandbox and delete every snapshot the server lists (a snapshot is a
    template: the SDK deletes it through the template API)."""
    from e2b import Sandbox

    with ctl.http() as http:
        for _ in range(5):
            sandboxes = list_all(ctl, "/v2/sandboxes", {"state": "running,paused", "limit": "100"})
            snapshots = list_all(ctl, "/snapshots", {"limit": "100"})
            if not sandboxes and not snapshots:
                return
            for sbx in sandboxes:
                resp = http.delete(f"/sandboxes/{sbx['sandboxID']}")
                if resp.status_code >= 500:
                    ctl.report.add("five_xx", {"op": "cleanup", "status": resp.status_code,
                                               "request": f"DELETE {resp.url}", "worker": -1,
                                               "interrupted_window": False})
            for snap in snapshots:
                _gone_ok(functools.partial(Sandbox.delete_snapshot, str(snap.get("snapshotID")),
                                           **ctl.opts()))
    ctl.report.add("errors", {"op": "cleanup", "worker": -1,
                              "error": f"still listed after 5 rounds: {len(sandboxes)} sandboxes, "
                                       f"{len(snapshots)} snapshots"})


# What a running server holds for sandboxes yet to come (warm network slots): leaks only once
# it has stopped.
HELD_WHILE_UP = ("network_slots", "veths")


def wait_for_no_leaks(ctl: ServerControl, report: Report, baseline: Baseline,
                      timeout: float = 30.0, server_up: bool = False) -> dict[str, list[str]]:
    """Leaks once the server has had `timeout` seconds to finish its background removals."""
    deadline = time.monotonic() + timeout
    while True:
        found = leaks(ctl, report, baseline)
        if server_up:
            found = {k: v for k, v in found.items() if k not in HELD_WHILE_UP}
        if not any(found.values()) or time.monotonic() >= deadline:
            return found
        time.sleep(1)


# ----------------------------------------------------------------------------- the run


def summarize(report: Report) -> dict[str, dict[str, float]]:
    table = {}
    for name, stats in sorted(report.ops.items()):
        ms = [s * 1000 for s in stats.seconds]
        table[name] = {"done": stats.done, "interrupted": stats.interrupted, "errors": stats.errors,
                       "p50_ms": round(percentile(ms, 0.5), 1) if ms else 0.0,
                       "p99_ms": round(percentile(ms, 0.99), 1) if ms else 0.0,
                       "max_ms": round(max(ms), 1) if ms else 0.0}
    return table


def run(args: argparse.Namespace) -> dict[str, Any]:
    report = Report()
    rng = random.Random(args.seed)
    home = prepare_home("aenv-soak-")
    baseline = Baseline(cgroup_names(), mounts_under(home), netns_names())
    ctl = ServerControl(home, report)
    started = time.monotonic()
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                              "home": str(home)}
    try:
        result["first_start_s"] = round(ctl.start(), 2)
        run_started = time.monotonic()
        deadline = run_started + args.minutes * 60
        gate = Gate()
        workers = [Worker(i, ctl, gate, report, deadline, args.files, rng.randrange(1 << 30))
                   for i in range(args.sandboxes)]
        stop = threading.Event()
        kill_thread = threading.Thread(target=killer, name="soak-killer", daemon=True,
                                       args=(ctl, gate, args.kill_mode, args.kill_every, deadline, stop,
                                             random.Random(rng.randrange(1 << 30))))
        for w in workers:
            w.start()
        if args.kill_every > 0:
            kill_thread.start()
        # Workers stop at the deadline after their current operation; bounded all the same.
        for w in workers:
            w.join(timeout=max(1.0, deadline - time.monotonic()) + OP_TIMEOUT * MAX_ATTEMPTS)
        stop.set()
        if kill_thread.is_alive():
            kill_thread.join(timeout=RESTART_TIMEOUT + 30)
        result["run_s"] = round(time.monotonic() - run_started, 1)
        result["stuck_workers"] = [w.index for w in workers if w.is_alive()]
        phases: list[Callable[[], None]] = [lambda: final_checks(ctl, report, workers, args.files),
                                            lambda: remove_everything(ctl)]
        for phase in phases:
            try:
                phase()
            except Exception as exc:  # noqa: BLE001 - reported; the leak search still runs
                report.add("errors", {"op": "final phase", "worker": -1,
                                      "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        # what the server removes in the background after a kill or delete: given time while
        # it still runs, then looked for again once it has stopped
        wait_for_no_leaks(ctl, report, baseline, server_up=True)
    finally:
        ctl.stop()
        result["leaks"] = wait_for_no_leaks(ctl, report, baseline, timeout=5.0)
        result["host_changes_not_attributed"] = {"netns": sorted(netns_names() - baseline.netns)}
        result["repository_after_cleanup"] = repository_state(home)
        if not args.keep_home:
            remove_home(home)
    result["total_s"] = round(time.monotonic() - started, 1)
    result["operations"] = summarize(report)
    result["cycles"] = report.cycles
    result["faults"] = {"kills": len(report.kills), "mode": args.kill_mode, "details": report.kills}
    result["files"] = {"written": report.files_written, "verified": report.files_verified,
                       "lost": report.files_lost}
    result["five_xx"] = report.five_xx
    result["errors"] = report.errors
    result["lost"] = report.lost
    result["unusable_snapshots"] = report.unusable_snapshots
    result["invariants"] = {
        "no_5xx": not report.five_xx,
        "nothing_lost": report.files_lost == 0 and not report.lost,
        "nothing_leaked": not any(result["leaks"].values()),
        "listed_snapshots_usable": not report.unusable_snapshots,
    }
    result["ok"] = all(result["invariants"].values())
    return result


def print_summary(result: dict[str, Any]) -> None:
    print(f"soak: {result['config']['minutes']} min, {result['config']['sandboxes']} workers, "
          f"kill -9 every {result['config']['kill_every']} s ({result['faults']['mode']}): "
          f"{result['faults']['kills']} kills, {result['cycles']} cycles, {result['total_s']} s in all")
    print(f"{'operation':<28}{'done':>7}{'interr.':>8}{'errors':>7}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, row in result["operations"].items():
        print(f"{name:<28}{row['done']:>7}{row['interrupted']:>8}{row['errors']:>7}"
              f"{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}{row['max_ms']:>10.1f}")
    files = result["files"]
    print(f"files: {files['written']} written, {files['verified']} verified, {files['lost']} lost")
    print(f"5xx answers: {len(result['five_xx'])}; errors: {len(result['errors'])}; "
          f"unusable listed snapshots: {len(result['unusable_snapshots'])}")
    leaked = {k: v for k, v in result["leaks"].items() if v}
    print(f"leaks: {json.dumps(leaked) if leaked else 'none'}")
    print(f"repository after cleanup (left to its gc): {json.dumps(result['repository_after_cleanup'])}")
    for kind in ("lost", "five_xx", "errors", "unusable_snapshots"):
        for item in result[kind][:10]:
            print(f"  {kind}: {json.dumps(item)[:400]}")
    print("invariants: " + ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in result["invariants"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long workers cycle")
    parser.add_argument("--sandboxes", type=int, default=4, help="workers (each one sandbox at a time, "
                        "plus its fork children and snapshot copy)")
    parser.add_argument("--kill-every", type=float, default=180.0,
                        help="seconds between server kill -9s (0: none)")
    parser.add_argument("--kill-mode", choices=("anywhere", "between"), default="anywhere",
                        help="anywhere: whatever is in flight; between: once no SDK call is")
    parser.add_argument("--files", type=int, default=200, help="files written to each sandbox")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--json", type=Path, default=None, help="write the report there")
    parser.add_argument("--keep-home", action="store_true", help="leave the server's home for a post-mortem")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sandboxes < 1 or args.files < 1:
        parser.error("--minutes, --sandboxes and --files must be positive")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    try:
        result = run(args)
    except RuntimeError as exc:  # the server did not start (or restart): nothing to report
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    print_summary(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
