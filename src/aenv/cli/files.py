"""`aenv upload`, `aenv download` and `aenv connect`: files and a shell of a running sandbox.

Owns: moving files between this machine and a sandbox through envd's `/files` API behind the
server's proxy (streamed in chunks both ways, with a progress bar for large files; a
directory travels as a tar archive unpacked by `tar` inside the sandbox or by `tarfile`
here), and attaching `cli.shell.attach_shell` to an existing sandbox. Must not touch:
anything on the server side; talks HTTP only through `cli.client.Client`.
"""

from __future__ import annotations

import argparse
import base64
import os
import posixpath
import secrets
import shlex
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from aenv.cli.client import ApiError, Client
from aenv.cli.output import emit
from aenv.progress import ProgressBar

CHUNK = 1 << 20
# Below this a bar would only flash by.
PROGRESS_MIN_BYTES = 4 << 20
TRANSFER_COLUMNS = ("sandboxID", "source", "destination", "bytes", "kind")


def sandbox_token(client: Client, sandbox_id: str) -> str | None:
    """The sandbox's envd token (also the check that the sandbox exists: a clean 404)."""
    info: dict[str, Any] = client.call("GET", f"/sandboxes/{sandbox_id}").json()
    if info.get("state") == "paused":
        raise ApiError(0, f"sandbox {sandbox_id} is paused: `aenv resume {sandbox_id}` first")
    token = info.get("envdAccessToken")
    return str(token) if token else None


class _Progress:
    """A ProgressBar for transfers of at least PROGRESS_MIN_BYTES; silent below."""

    def __init__(self, label: str, total: int | None) -> None:
        self.bar = (ProgressBar(label, float(total)) if total and total >= PROGRESS_MIN_BYTES
                    else None)
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.done, f"{self.done / 2**20:.1f} MiB")

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish(f"{self.done / 2**20:.1f} MiB")


def _chunks(source: IO[bytes], progress: _Progress) -> Iterator[bytes]:
    while chunk := source.read(CHUNK):
        progress.add(len(chunk))
        yield chunk


def _run(client: Client, sandbox_id: str, token: str | None, script: str, user: str | None
         ) -> None:
    """Run a shell script in the sandbox; its stderr becomes the error when it fails."""
    message = {"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": False}
    stderr, exit_code = b"", 0
    for msg in client.stream(sandbox_id, token, "process.Process/Start", message, user=user):
        event = msg.get("event", {})
        if "stderr" in event.get("data", {}):
            stderr += base64.b64decode(event["data"]["stderr"])
        if "end" in event:
            exit_code = int(event["end"].get("exitCode", 0))
    if exit_code:
        raise ApiError(0, stderr.decode(errors="replace").strip() or f"exit code {exit_code}")


def cmd_upload(args: argparse.Namespace, client: Client) -> int:
    local = Path(args.local)
    if not local.exists():
        raise ApiError(0, f"{local}: no such file or directory")
    if not (local.is_file() or local.is_dir()):
        raise ApiError(0, f"{local}: not a regular file or directory")
    token = sandbox_token(client, args.sandbox_id)
    remote = args.remote
    if remote.endswith("/") and local.is_file():
        remote = posixpath.join(remote, local.name)
    if local.is_file():
        size = local.stat().st_size
        try:
            with local.open("rb") as f:
                progress = _Progress(f"upload {local.name}", size)
                client.upload_file(args.sandbox_id, token, remote, _chunks(f, progress), size,
                                   args.user)
        except OSError as exc:
            raise ApiError(0, f"{local}: {exc.strerror or exc}") from None
        progress.finish()
        kind = "file"
    else:
        # One archive, unpacked by the sandbox's own tar, as the user (their permissions).
        staging = f"/tmp/.aenv-upload-{secrets.token_hex(8)}.tar"
        with tempfile.TemporaryFile() as archive:
            with tarfile.open(fileobj=archive, mode="w") as tar:
                tar.add(local, arcname=".")
            size = archive.tell()
            archive.seek(0)
            progress = _Progress(f"upload {local.name}/", size)
            client.upload_file(args.sandbox_id, token, staging, _chunks(archive, progress), size,
                               args.user)
            progress.finish()
        quoted, staged = shlex.quote(remote), shlex.quote(staging)
        _run(client, args.sandbox_id, token,
             f"mkdir -p -- {quoted} && tar -xf {staged} -C {quoted}; rc=$?; rm -f {staged}; "
             "exit $rc", args.user)
        kind = "directory"
    emit({"sandboxID": args.sandbox_id, "source": str(local), "destination": remote,
          "bytes": size, "kind": kind}, TRANSFER_COLUMNS, args.output == "json")
    return 0


def _replace_with(target: Path, fill: Any) -> None:
    """Write `target` through a temporary sibling: an interrupted download leaves no half file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_download(args: argparse.Namespace, client: Client) -> int:
    token = sandbox_token(client, args.sandbox_id)
    remote = args.remote
    local = Path(args.local)
    if not local.parent.is_dir():
        raise ApiError(0, f"{local.parent}: no such directory")

    def fetch(out: IO[bytes], path: str, label: str) -> int:
        progress = _Progress(label, None)
        for chunk, total in client.download_file(args.sandbox_id, token, path, args.user):
            if progress.bar is None and progress.done == 0 and total:
                progress = _Progress(label, total)
            out.write(chunk)
            progress.add(len(chunk))
        progress.finish()
        return progress.done

    try:
        target = local / posixpath.basename(remote.rstrip("/")) if local.is_dir() else local
        size = [0]
        try:
            _replace_with(target, lambda out: size.__setitem__(0, fetch(out, remote,
                                                                           f"download {remote}")))
            kind = "file"
        except ApiError as exc:
            if exc.status != 400 or "is a directory" not in exc.message:
                raise
            kind = "directory"
            size[0] = _download_dir(client, args, token, remote, target, fetch)
    except OSError as exc:
        raise ApiError(0, f"{local}: {exc.strerror or exc}") from None
    emit({"sandboxID": args.sandbox_id, "source": remote, "destination": str(target),
          "bytes": size[0], "kind": kind}, TRANSFER_COLUMNS, args.output == "json")
    return 0


def _download_dir(client: Client, args: argparse.Namespace, token: str | None, remote: str,
                  local: Path, fetch: Any) -> int:
    """The sandbox's tar packs the directory, as the user; tarfile's `data` filter unpacks it
    here (no absolute paths, no `..`, no device files, no links out of `local`)."""
    staging = f"/tmp/.aenv-download-{secrets.token_hex(8)}.tar"
    staged = shlex.quote(staging)
    _run(client, args.sandbox_id, token, f"tar -cf {staged} -C {shlex.quote(remote)} .",
         args.user)
    try:
        with tempfile.TemporaryFile() as archive:
            size: int = fetch(archive, staging, f"download {remote}/")
            archive.seek(0)
            local.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=archive, mode="r") as tar:
                tar.extractall(local, filter="data")
    finally:
        _run(client, args.sandbox_id, token, f"rm -f {staged}", args.user)
    return size


def cmd_connect(args: argparse.Namespace, client: Client) -> int:
    from aenv.cli.shell import attach_shell

    token = sandbox_token(client, args.sandbox_id)
    print(f"connected to sandbox {args.sandbox_id} (exit the shell to leave it running)",
          file=sys.stderr)
    return attach_shell(client, args.sandbox_id, token)
