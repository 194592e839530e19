"""A stand-in for the `firecracker` binary, for unit tests on hosts without KVM/Firecracker.

    fake_firecracker.py --api-sock PATH --id ID     serve a fake API on PATH
    fake_firecracker.py --version                   print a version

It speaks HTTP/1.1 on the API socket like Firecracker, keeps the little state that makes
ordering mistakes visible (pre-boot vs running vs paused; /snapshot/load only on a fresh
process; /snapshot/create only while paused; drives and memory files must exist, relative
paths resolved against the cwd as Firecracker does), and appends every request as a JSON line
to $FAKE_FC_RECORD. It validates nothing against the OpenAPI description: the tests do that
on the recorded requests. Snapshots are symbolic: `vmstate` is JSON, and each
/snapshot/create writes one 4 KiB page, at page index = the number of snapshots made so far
by every fake process of the test, into a sparse memory file of the VM's size.
Standard library only; not a test module.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

VERSION = "1.16.1"
PAGE = 4096


class Vm:
    def __init__(self, instance_id: str) -> None:
        self.id = instance_id
        self.state = "Not started"
        self.configured: set[str] = set()
        self.mem_mib = 128
        self.loaded = False

    def fault(self, message: str) -> tuple[int, dict[str, Any]]:
        return 400, {"fault_message": message}

    def handle(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any] | None]:
        record = os.environ.get("FAKE_FC_RECORD")
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"id": self.id, "pid": os.getpid(), "method": method,
                                    "path": path, "body": body}) + "\n")
        started = self.state != "Not started"
        if method == "GET" and path == "/":
            return 200, {"app_name": "Firecracker", "id": self.id, "state": self.state,
                         "vmm_version": VERSION}
        if method == "GET" and path == "/version":
            return 200, {"firecracker_version": VERSION}
        if method == "GET" and path == "/balloon/statistics":
            return 200, {"target_pages": 0, "actual_pages": 0, "target_mib": 0,
                         "actual_mib": 0, "total_memory": self.mem_mib << 20,
                         "available_memory": (self.mem_mib << 20) // 2, "disk_caches": 4096}
        if not isinstance(body, dict):
            return self.fault("the request body must be a JSON object")
        if method == "PUT" and path in ("/logger", "/metrics"):
            if self.loaded or started:
                return self.fault(f"{path} can only be configured before boot")
            target = body.get("log_path") or body.get("metrics_path")
            Path(target).touch()
            self.configured.add(path)
            return 204, None
        if method == "PUT" and path == "/snapshot/load":
            if started or self.configured - {"/logger", "/metrics"}:
                return self.fault("Loading a microVM snapshot not allowed after configuring "
                                  "boot-specific resources.")
            try:
                state = json.loads(Path(body["snapshot_path"]).read_text())
            except (OSError, ValueError) as exc:
                return self.fault(f"Load snapshot error: {exc}")
            mem = body.get("mem_backend", {}).get("backend_path", "")
            if not os.path.isfile(mem):
                return self.fault(f"Load snapshot error: no memory file {mem}")
            for drive in state["drives"]:  # reopened by the path the snapshot recorded
                if not os.path.isfile(drive):
                    return self.fault(f"Load snapshot error: drive {drive}: not found")
            self.mem_mib, self.loaded = state["mem_mib"], True
            self.configured = set(state["configured"])
            self.state = "Running" if body.get("resume_vm") else "Paused"
            return 204, None
        if method == "PUT" and path == "/actions":
            if body.get("action_type") == "InstanceStart":
                if started:
                    return self.fault("The microVM is already running.")
                if "/boot-source" not in self.configured:
                    return self.fault("Cannot start microvm without kernel configuration.")
                self.state = "Running"
                if not os.environ.get("FAKE_FC_NO_BOOT"):
                    print("[    0.500000] Run /sbin/init as init process", flush=True)
            return 204, None
        if method == "PATCH" and path == "/vm":
            if not started:
                return self.fault("The microVM is not running.")
            self.state = "Paused" if body.get("state") == "Paused" else "Running"
            return 204, None
        if method == "PUT" and path == "/snapshot/create":
            if self.state != "Paused":
                return self.fault("Create snapshot error: the microVM must be paused.")
            drives = sorted(p for p in self.configured if p.startswith("drive:"))
            Path(body["snapshot_path"]).write_text(json.dumps({
                "mem_mib": self.mem_mib, "configured": sorted(self.configured),
                "drives": [d.removeprefix("drive:") for d in drives]}))
            count = 0
            if record:
                with open(record) as f:
                    count = sum('"/snapshot/create"' in line for line in f) - 1
            with open(body["mem_file_path"], "wb") as f:
                f.truncate(self.mem_mib << 20)
                f.seek(count * PAGE)
                f.write(bytes([65 + count]) * PAGE)
            return 204, None
        if started or self.loaded:
            if method == "PATCH":
                return 204, None
            return self.fault(f"{path} is a pre-boot resource")
        if method == "PUT" and path.startswith("/drives/"):
            if not os.path.isfile(body.get("path_on_host", "")):
                return self.fault(f"Unable to open drive file {body.get('path_on_host')}")
            self.configured.add("drive:" + body["path_on_host"])
            return 204, None
        if method == "PUT" and path == "/machine-config":
            self.mem_mib = int(body["mem_size_mib"])
        if method in ("PUT", "PATCH") and path in ("/machine-config", "/boot-source",
                                                   "/balloon", "/vsock") or (
                method == "PUT" and path.startswith("/network-interfaces/")):
            self.configured.add(path)
            return 204, None
        return self.fault(f"Invalid request method and/or path: {method} {path}.")


async def serve(sock_path: str, instance_id: str) -> None:
    vm = Vm(instance_id)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                status, reply = vm.handle(method, target, body)
                payload = json.dumps(reply).encode() if reply is not None else b""
                reason = {200: "OK", 204: "No Content", 400: "Bad Request"}[status]
                writer.write(f"HTTP/1.1 {status} {reason}\r\nServer: Firecracker API\r\n"
                             f"Content-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(client, path=sock_path)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if "--version" in argv:
        print(f"Firecracker v{VERSION}\n\nSupported snapshot data format versions: v8.0.0")
        return 0
    sock = argv[argv.index("--api-sock") + 1]
    instance_id = argv[argv.index("--id") + 1] if "--id" in argv else "anonymous-instance"
    asyncio.run(serve(sock, instance_id))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
