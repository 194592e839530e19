"""The `filesystem.Filesystem` Connect service.

Owns: Stat, MakeDir, Move, ListDir (with depth), Remove, the WatchDir stream and the
polling watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher).

Every operation runs with the requesting user's filesystem credentials
(`FsCredentials.as_user`), so the kernel decides what the user may stat, list, create,
move, remove and watch, and what is created belongs to the user (Go envd runs them as root
and chowns; a user must not reach through envd what its own processes cannot). Watches add
the directories that appear later with the same credentials. Long walks (deep ListDir,
removing a big tree) are generators stepped through `FsCredentials.steps`, yielding to the
event loop every few hundred entries so other streams keep flowing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aenv.envd.channel import Channel
from aenv.envd.connect import Call, Method, ServerStream, server_stream, unary
from aenv.envd.entries import ensure_dirs, os_error, resolve_path
from aenv.envd.errors import RpcError, internal, invalid, not_found
from aenv.envd.fscreds import STEP_YIELD_EVERY
from aenv.envd.inotify import CHMOD, CREATE, WRITE, Watcher, is_network_mount
from aenv.envd.proto import Msg, get_bool, get_int, get_str
from aenv.envd.users import User

if TYPE_CHECKING:
    from aenv.envd.server import App

MAX_PENDING_EVENTS = 100_000  # a forgotten polling watcher must not grow without bound


class PollingWatcher:
    def __init__(self, watcher: Watcher, events: Channel[Msg]) -> None:
        self.watcher = watcher
        self.events = events


class FilesystemService:
    def __init__(self, app: App) -> None:
        self.app = app
        self._watchers: dict[str, PollingWatcher] = {}

    def methods(self) -> dict[str, Method]:
        prefix = "/filesystem.Filesystem/"
        return {
            prefix + "Stat": unary(self.stat),
            prefix + "MakeDir": unary(self.make_dir),
            prefix + "Move": unary(self.move),
            prefix + "ListDir": unary(self.list_dir),
            prefix + "Remove": unary(self.remove),
            prefix + "WatchDir": server_stream(self.watch_dir),
            prefix + "CreateWatcher": unary(self.create_watcher),
            prefix + "GetWatcherEvents": unary(self.get_watcher_events),
            prefix + "RemoveWatcher": unary(self.remove_watcher),
        }

    def _path(self, call: Call, message: Msg, field: str = "path") -> tuple[User, str]:
        user = self.app.user(call.username)
        return user, resolve_path(get_str(message, field), user, self.app.settings.default_workdir)

    async def stat(self, call: Call, message: Msg) -> Msg:
        user, path = self._path(call, message)
        with self.app.creds.as_user(user):
            return {"entry": self.app.entries.info(path)}

    async def make_dir(self, call: Call, message: Msg) -> Msg:
        user, path = self._path(call, message)
        with self.app.creds.as_user(user):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise os_error(e, "error getting file info: stat", path) from None
            else:
                if stat.S_ISDIR(st.st_mode):
                    raise RpcError("already_exists", f"directory already exists: {path}")
                raise invalid(f"path already exists but it is not a directory: {path}")
            ensure_dirs(path, user.uid, user.gid)
            return {"entry": self.app.entries.info(path)}

    async def move(self, call: Call, message: Msg) -> Msg:
        user, source = self._path(call, message, "source")
        _, destination = self._path(call, message, "destination")
        with self.app.creds.as_user(user):
            ensure_dirs(os.path.dirname(destination), user.uid, user.gid)
            try:
                os.rename(source, destination)
            except FileNotFoundError:
                raise not_found(f"source file not found: rename {source} {destination}: no such file or directory") from None
            except OSError as e:  # permission_denied, failed_precondition (ENOTEMPTY, EXDEV), ...
                raise os_error(e, "error renaming: rename", f"{source} {destination}") from None
            return {"entry": self.app.entries.info(destination)}

    async def list_dir(self, call: Call, message: Msg) -> Msg:
        user, requested = self._path(call, message)
        depth = get_int(message, "depth") or 1
        with self.app.creds.as_user(user):
            resolved = self._list_root(requested)
        entries: list[Msg] = []
        await self.app.creds.steps(user, self._walk(resolved, requested.rstrip("/") or "/", depth, entries))
        return {"entries": entries} if entries else {}

    @staticmethod
    def _list_root(requested: str) -> str:
        """The directory a ListDir walks (symlinks resolved), checked to be one."""
        try:
            resolved = os.path.realpath(requested, strict=True)
        except FileNotFoundError:
            raise not_found(f"path not found: {requested}") from None
        except RuntimeError:
            raise RpcError("failed_precondition", f"cyclic symlink at {requested!r}") from None
        except OSError as e:
            raise os_error(e, "error resolving symlink", requested) from None
        try:
            if not stat.S_ISDIR(os.stat(resolved).st_mode):
                raise invalid(f"path is not a directory: {resolved}")
        except FileNotFoundError:
            raise not_found(f"directory not found: {resolved}") from None
        except OSError as e:
            raise os_error(e, "error getting file info: stat", resolved) from None
        return resolved

    def _walk(self, real: str, shown: str, depth: int, out: list[Msg]) -> Iterator[None]:
        """Depth-first in name order, like Go's WalkDir; symlinks are not followed. A
        generator for `FsCredentials.steps`: yields every STEP_YIELD_EVERY entries."""
        try:
            with os.scandir(real) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise os_error(e, "error reading directory", real) from None
        for child in children:
            try:
                st = child.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we were listing
            entry = self.app.entries.from_stat(child.path, st)
            entry["path"] = os.path.join(shown, child.name)
            out.append(entry)
            if len(out) % STEP_YIELD_EVERY == 0:
                yield
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                yield from self._walk(child.path, entry["path"], depth - 1, out)

    async def remove(self, call: Call, message: Msg) -> Msg:
        user, path = self._path(call, message)
        try:
            await self.app.creds.steps(user, _remove_all(path, [0]))
        except OSError as e:  # permission_denied, invalid_argument (a name too long), ...
            code = os_error(e, "", path).code
            raise RpcError(code, f"error removing file or directory: {e.strerror}: {e.filename or path}") from None
        return {}

    # -- watching -----------------------------------------------------------------------

    def _watch_path(self, call: Call, message: Msg) -> tuple[User, str]:
        user, path = self._path(call, message)
        with self.app.creds.as_user(user):
            self._check_watchable(path, message)
        return user, path

    @staticmethod
    def _check_watchable(path: str, message: Msg) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise not_found(f"path {path} not found") from None
        except OSError as e:
            raise os_error(e, "error statting path", path) from None
        if not stat.S_ISDIR(st.st_mode):
            raise invalid(f"path {path} not a directory")
        if not get_bool(message, "allowNetworkMounts", "allow_network_mounts") and is_network_mount(path):
            raise invalid(f"cannot watch path on network filesystem: {path}")

    def _watcher(self, user: User, path: str, message: Msg, sink: Channel[Msg]) -> Watcher:
        include_entry = get_bool(message, "includeEntry", "include_entry")
        entries = self.app.entries

        def on_event(name: str, kind: str, full: str) -> None:
            event: Msg = {"name": name, "type": kind}
            if include_entry and kind in (CREATE, WRITE, CHMOD):
                try:
                    event["entry"] = entries.info(full)
                except RpcError:
                    pass  # gone again already: entry info is best effort
            sink.push(event)

        # inotify_add_watch needs read permission on the directory: as the user, for the
        # root and for every directory a recursive watch adds later (and entry infos).
        creds = self.app.creds
        watcher = Watcher(path, get_bool(message, "recursive"), on_event, lambda: creds.as_user(user))
        try:
            watcher.start()
        except PermissionError as e:
            raise RpcError("permission_denied", str(e)) from None
        except OSError as e:
            raise internal(str(e)) from None
        return watcher

    async def watch_dir(self, call: Call, message: Msg, stream: ServerStream) -> None:
        user, path = self._watch_path(call, message)
        events: Channel[Msg] = Channel()
        watcher = self._watcher(user, path, message, events)
        try:
            await stream.send({"start": {}})
            while True:
                event = await events.get(call.keepalive)
                if event is None:
                    await stream.send({"keepalive": {}})
                else:
                    await stream.send({"filesystem": event})
        finally:
            watcher.close()

    async def create_watcher(self, call: Call, message: Msg) -> Msg:
        user, path = self._watch_path(call, message)
        events: Channel[Msg] = Channel(MAX_PENDING_EVENTS)
        watcher = self._watcher(user, path, message, events)
        watcher_id = "w" + os.urandom(10).hex()
        self._watchers[watcher_id] = PollingWatcher(watcher, events)
        return {"watcherId": watcher_id}

    def _polling(self, message: Msg) -> tuple[str, PollingWatcher]:
        watcher_id = get_str(message, "watcherId", "watcher_id")
        polling = self._watchers.get(watcher_id)
        if polling is None:
            raise not_found(f"watcher with id {watcher_id} not found")
        return watcher_id, polling

    async def get_watcher_events(self, call: Call, message: Msg) -> Msg:
        _, polling = self._polling(message)
        events = polling.events.drain()
        return {"events": events} if events else {}

    async def remove_watcher(self, call: Call, message: Msg) -> Msg:
        watcher_id, polling = self._polling(message)
        polling.watcher.close()
        del self._watchers[watcher_id]
        return {}

    def close(self) -> None:
        for polling in self._watchers.values():
            polling.watcher.close()
        self._watchers.clear()


def _remove_all(path: str, counter: list[int]) -> Iterator[None]:
    """`os.RemoveAll`: a missing path is not an error; symlinks are removed, not followed.
    A generator for `FsCredentials.steps`: yields every STEP_YIELD_EVERY entries."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        with os.scandir(path) as it:
            children = [child.path for child in it]
        for child in children:
            yield from _remove_all(child, counter)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    counter[0] += 1
    if counter[0] % STEP_YIELD_EVERY == 0:
        yield
