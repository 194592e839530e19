"""`aenv build Dockerfile --name NAME`: a Dockerfile subset built into a template.

Owns: reading the Dockerfile and the build context, packing each COPY/ADD source (a tar,
gzip, named relative to the context, hashed for the server's upload cache), the E2B build
calls (`POST /v3/templates`, the file links and uploads, `POST /v2/templates/{id}/builds/{b}`)
and following the build's log until it ends. Must not touch: anything on the server side;
talks HTTP only to the control plane.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

from aenv.builds.dockerfile import DockerfileError, parse
from aenv.cli.client import ApiError, Client
from aenv.cli.output import emit
from aenv.cli.pull import TEMPLATE_COLUMNS

POLL_S = 0.3


def _matches(context: Path, src: str) -> list[Path]:
    """What a COPY source names in the context: matches of the glob, directories recursively."""
    found = sorted(glob.glob(src, root_dir=context, recursive=True, include_hidden=True))
    if not found:
        raise ApiError(0, f"COPY {src}: no such file in the build context {context}")
    out: list[Path] = []
    for rel in found:
        path = (context / rel).resolve()
        if path != context and context not in path.parents:
            raise ApiError(0, f"COPY {src}: {rel} is outside the build context")
        out.append(context / os.path.normpath(rel))
        if path.is_dir() and not (context / rel).is_symlink():
            for root, dirs, files in os.walk(context / rel):
                dirs.sort()
                out.extend(Path(root) / name for name in sorted([*dirs, *files]))
    return out


def pack(context: Path, src: str, dest: str) -> tuple[str, IO[bytes]]:
    """(sha256 of the selection, a gzip tar of it named relative to the context)."""
    digest = hashlib.sha256(f"COPY {src} {dest}".encode())
    archive = tempfile.TemporaryFile()  # noqa: SIM115 - the caller closes it
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for path in _matches(context, src):
            rel = os.path.relpath(path, context)
            st = path.lstat()
            digest.update(f"{rel}\0{st.st_mode}\0{st.st_size}\0".encode())
            if path.is_file() and not path.is_symlink():
                with path.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
            elif path.is_symlink():
                digest.update(os.readlink(path).encode())
            tar.add(path, arcname=rel, recursive=False)
    archive.seek(0)
    return digest.hexdigest(), archive


class BuildLog:
    """Prints the build's log: step headers stand out on a terminal, output is indented."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def entry(self, entry: dict[str, Any]) -> None:
        message, level = str(entry.get("message", "")), entry.get("level", "info")
        if message.startswith("[") and "/" in message.split("]", 1)[0]:
            line = f"\x1b[1m{message}\x1b[0m" if self.tty else message
        elif level == "error":
            line = f"\x1b[31m{message}\x1b[0m" if self.tty else f"error: {message}"
        else:
            line = f"  {message}"
        print(line, file=sys.stderr, flush=True)


def cmd_build(args: argparse.Namespace, client: Client) -> int:
    dockerfile = Path(args.dockerfile)
    try:
        text = dockerfile.read_text()
    except OSError as exc:
        raise ApiError(0, f"cannot read {dockerfile}: {exc.strerror or exc}") from None
    context = Path(args.context or dockerfile.parent).resolve()
    if not context.is_dir():
        raise ApiError(0, f"the build context {context} is not a directory")
    build_args: dict[str, str] = {}
    for item in args.build_arg or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ApiError(0, f"--build-arg needs KEY=VALUE, got {item!r}")
        build_args[key] = value
    try:
        parsed = parse(text, build_args)
    except DockerfileError as exc:
        raise ApiError(0, str(exc)) from None
    for warning in parsed.warnings:
        print(f"aenv: warning: {warning}", file=sys.stderr)
    started = time.monotonic()
    archives: list[IO[bytes] | None] = []
    steps: list[dict[str, Any]] = []
    try:
        for step in parsed.steps:
            body: dict[str, Any] = {"type": step["type"], "args": step["args"], "force": False}
            archive = None
            if step["type"] in ("COPY", "ADD"):
                step_args = step["args"]
                assert isinstance(step_args, list)
                body["filesHash"], archive = pack(context, str(step_args[0]), str(step_args[1]))
            archives.append(archive)
            steps.append(body)
        request = client.call("POST", "/v3/templates", {"name": args.name}).json()
        template_id, build_id = request["templateID"], request["buildID"]
        print(f"building {args.name} (template {template_id}, build {build_id})", file=sys.stderr)
        for step_body, archive in zip(steps, archives):
            if archive is not None:
                _upload(client, template_id, step_body["filesHash"], archive,
                        str(step_body["args"][0]))
        start: dict[str, Any] = {"fromImage": parsed.from_image, "steps": steps, "force": False}
        start_cmd = args.start_cmd if args.start_cmd is not None else parsed.start_cmd
        if start_cmd:
            start["startCmd"] = start_cmd
        if args.ready_cmd:
            start["readyCmd"] = args.ready_cmd
        client.call("POST", f"/v2/templates/{template_id}/builds/{build_id}", start)
    finally:
        for archive in archives:
            if archive is not None:
                archive.close()
    status = _follow(client, template_id, build_id)
    if status["status"] != "ready":
        reason = status.get("reason") or {}
        failed_step = reason.get("step")
        where = f" at step {failed_step}" if failed_step else ""
        raise ApiError(0, f"build failed{where}: {reason.get('message', 'unknown error')}")
    row = client.call("GET", f"/templates/{template_id}").json()
    if args.output == "json":
        emit({k: row.get(k) for k in (*TEMPLATE_COLUMNS, "buildID")}, TEMPLATE_COLUMNS, True)
    else:
        print(f"built {args.name} in {time.monotonic() - started:.1f}s: template {template_id}; "
              f"start it with `aenv start {args.name}`")
    return 0


def _upload(client: Client, template_id: str, files_hash: str, archive: IO[bytes],
            src: str) -> None:
    link = client.call("GET", f"/templates/{template_id}/files/{files_hash}").json()
    if link.get("present"):
        print(f"  {src}: already uploaded", file=sys.stderr)
        return
    size = os.fstat(archive.fileno()).st_size
    try:
        with httpx.Client(timeout=httpx.Timeout(60, write=None)) as http:
            resp = http.put(link["url"], content=archive,
                            headers={**link.get("headers", {}), "Content-Length": str(size)})
    except httpx.HTTPError as exc:
        raise ApiError(0, f"upload of {src} failed: {exc}") from None
    if resp.status_code >= 300:
        raise ApiError(resp.status_code, f"upload of {src} failed: {resp.text[:200]}")
    print(f"  {src}: uploaded {size / 1e6:.1f} MB", file=sys.stderr)


def cmd_template_watch(args: argparse.Namespace, client: Client) -> int:
    """`aenv template watch TEMPLATE [BUILD]`: the build's log until it ends (the latest
    build unless one is named); exit 1 when it failed."""
    if not args.targets or len(args.targets) > 2:
        raise ApiError(0, "template watch needs a template id or name, and optionally a build id")
    template: dict[str, Any] = client.call("GET", f"/templates/{args.targets[0]}").json()
    builds: list[dict[str, Any]] = template.get("builds", [])  # newest first
    if len(args.targets) == 2:
        build_id = args.targets[1]
    elif builds:
        build_id = builds[0]["buildID"]
    else:
        raise ApiError(0, f"template {args.targets[0]} has no builds to watch")
    template_id = template["templateID"]
    print(f"watching build {build_id} of template {template_id}", file=sys.stderr)
    status = _follow(client, template_id, build_id)
    summary = {"templateID": template_id, "buildID": build_id, "status": status["status"]}
    if status.get("reason"):
        summary["reason"] = status["reason"]
    if args.output == "json":
        emit(summary, ("templateID", "buildID", "status"), True)
    else:
        reason = (status.get("reason") or {}).get("message")
        print(f"build {build_id}: {status['status']}{f' ({reason})' if reason else ''}")
    return 0 if status["status"] == "ready" else 1


def _follow(client: Client, template_id: str, build_id: str) -> dict[str, Any]:
    out = BuildLog()
    offset = 0
    while True:
        status: dict[str, Any] = client.call(
            "GET", f"/templates/{template_id}/builds/{build_id}/status?logsOffset={offset}"
        ).json()
        entries = status.get("logEntries", [])
        for entry in entries:
            out.entry(entry)
        offset += len(entries)
        if status["status"] in ("ready", "error") and not entries:
            return status
        if not entries:
            time.sleep(POLL_S)
