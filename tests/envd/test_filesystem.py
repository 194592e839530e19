"""The filesystem service through the official SDK: list, stat, make_dir, rename, remove,
and directory watching (sync polling and async streaming)."""

from __future__ import annotations

import asyncio
import os
import pwd
import time
from pathlib import Path

import pytest
from e2b import (
    AsyncSandbox,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    Sandbox,
)


def test_list_honours_depth(sbx: Sandbox, work: Path) -> None:
    (work / "d1/d2/d3").mkdir(parents=True)
    (work / "top.txt").write_text("t")
    (work / "d1/mid.txt").write_text("m")
    (work / "d1/d2/deep.txt").write_text("d")
    one = sbx.files.list(str(work))
    assert sorted(e.name for e in one) == ["d1", "top.txt"]
    two = sbx.files.list(str(work), depth=2)
    assert sorted(e.path for e in two) == sorted(
        [f"{work}/d1", f"{work}/top.txt", f"{work}/d1/d2", f"{work}/d1/mid.txt"]
    )
    three = sbx.files.list(str(work), depth=3)
    assert f"{work}/d1/d2/deep.txt" in [e.path for e in three]
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        sbx.files.list(f"{work}/top.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.list(f"{work}/nope")


def test_get_info_fields(sbx: Sandbox, work: Path, test_user: pwd.struct_passwd) -> None:
    path = work / "info.txt"
    path.write_text("12345")
    os.chmod(path, 0o640)
    os.chown(path, test_user.pw_uid, 0)
    info = sbx.files.get_info(str(path))
    assert info.type == FileType.FILE
    assert (info.name, info.path, info.size) == ("info.txt", str(path), 5)
    assert info.mode == 0o640
    assert info.permissions == "-rw-r-----"
    assert (info.owner, info.group) == ("aenvtest", "root")
    assert abs(info.modified_time.timestamp() - path.stat().st_mtime) < 0.01
    assert info.symlink_target is None
    directory = sbx.files.get_info(str(work))
    assert directory.type == FileType.DIR
    assert directory.permissions.startswith("d")


def test_symlinks(sbx: Sandbox, work: Path) -> None:
    (work / "target.txt").write_text("t")
    (work / "link").symlink_to(work / "target.txt")
    (work / "dangling").symlink_to(work / "missing")
    info = sbx.files.get_info(f"{work}/link")
    assert info.type == FileType.SYMLINK
    assert info.symlink_target == f"{work}/target.txt"
    assert info.permissions.startswith("L")
    listed = {e.name: e for e in sbx.files.list(str(work))}
    assert listed["link"].type == FileType.SYMLINK
    assert listed["dangling"].type == FileType.SYMLINK
    assert sbx.files.read(f"{work}/link") == "t"


def test_exists_make_dir_rename_remove(sbx: Sandbox, work: Path, test_user: pwd.struct_passwd) -> None:
    assert sbx.files.exists(str(work)) is True
    assert sbx.files.exists(f"{work}/nothing") is False
    assert sbx.files.make_dir(f"{work}/x/y/z") is True
    assert sbx.files.make_dir(f"{work}/x/y/z") is False
    assert (work / "x/y").stat().st_uid == test_user.pw_uid
    (work / "x/y/z/file.txt").write_text("f")
    moved = sbx.files.rename(f"{work}/x/y/z/file.txt", f"{work}/moved/here.txt")
    assert (moved.name, moved.path, moved.type) == ("here.txt", f"{work}/moved/here.txt", FileType.FILE)
    assert (work / "moved/here.txt").read_text() == "f"
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(f"{work}/x/none", f"{work}/y")
    sbx.files.remove(f"{work}/x")
    assert not (work / "x").exists()
    sbx.files.remove(f"{work}/x")  # removing what is gone is fine, like rm -rf
    (work / "afile").write_text("a")
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir(f"{work}/afile")


def test_remove_does_not_follow_symlinks(sbx: Sandbox, work: Path) -> None:
    (work / "keep").mkdir()
    (work / "keep/precious.txt").write_text("p")
    (work / "tree").mkdir()
    (work / "tree/link").symlink_to(work / "keep")
    owner = (work.stat().st_uid, work.stat().st_gid)
    os.chown(work / "tree", *owner)  # the user's directory: the user may empty it
    sbx.files.remove(f"{work}/tree")
    assert (work / "keep/precious.txt").exists()
    assert not (work / "tree").exists()


def _wait_events(handle, want: set[tuple[str, FilesystemEventType]], timeout: float = 5):  # type: ignore[no-untyped-def]
    seen: set[tuple[str, FilesystemEventType]] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen |= {(e.name, e.type) for e in handle.get_new_events()}
        if want <= seen:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"missing {want - seen}; saw {seen}")


def test_watch_dir_polling(sbx: Sandbox, work: Path) -> None:
    handle = sbx.files.watch_dir(str(work))
    sbx.files.write(f"{work}/new.txt", "1")
    (work / "new.txt").rename(work / "renamed.txt")
    (work / "renamed.txt").unlink()
    _wait_events(
        handle,
        {
            ("new.txt", FilesystemEventType.CREATE),
            ("new.txt", FilesystemEventType.WRITE),
            ("new.txt", FilesystemEventType.RENAME),
            ("renamed.txt", FilesystemEventType.CREATE),
            ("renamed.txt", FilesystemEventType.REMOVE),
        },
    )
    handle.stop()


def test_watch_dir_recursive_polling_with_entries(sbx: Sandbox, work: Path) -> None:
    handle = sbx.files.watch_dir(str(work), recursive=True, include_entry=True)
    (work / "sub").mkdir()
    time.sleep(0.1)
    (work / "sub/inner.txt").write_text("i")
    (work / "sub/deeper/deepest").mkdir(parents=True)
    (work / "sub/deeper/deepest/f").write_text("f")
    seen = _wait_events(
        handle,
        {
            ("sub", FilesystemEventType.CREATE),
            ("sub/inner.txt", FilesystemEventType.CREATE),
            ("sub/inner.txt", FilesystemEventType.WRITE),
            ("sub/deeper/deepest/f", FilesystemEventType.CREATE),
        },
    )
    assert seen
    handle.stop()
    with pytest.raises(Exception, match="already stopped"):
        handle.get_new_events()


def test_watch_errors(sbx: Sandbox, work: Path) -> None:
    (work / "file").write_text("x")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        sbx.files.watch_dir(f"{work}/file")
    with pytest.raises(FileNotFoundException):
        sbx.files.watch_dir(f"{work}/missing")


async def test_watch_dir_streaming(asbx: AsyncSandbox, work: Path) -> None:
    events: list[tuple[str, FilesystemEventType, object]] = []
    exited: list[object] = []
    handle = await asbx.files.watch_dir(
        str(work),
        on_event=lambda e: events.append((e.name, e.type, e.entry)),
        on_exit=exited.append,
        recursive=True,
        include_entry=True,
    )
    await asbx.files.write(f"{work}/async.txt", "a")
    await asbx.files.make_dir(f"{work}/adir")
    await asyncio.sleep(0.1)
    await asbx.files.write(f"{work}/adir/nested.txt", "n")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and ("adir/nested.txt", FilesystemEventType.CREATE) not in [
        (n, t) for n, t, _ in events
    ]:
        await asyncio.sleep(0.05)
    await handle.stop()
    names = {(n, t) for n, t, _ in events}
    assert ("async.txt", FilesystemEventType.CREATE) in names
    assert ("adir", FilesystemEventType.CREATE) in names
    assert ("adir/nested.txt", FilesystemEventType.CREATE) in names
    entry = next(e for n, t, e in events if n == "async.txt" and t == FilesystemEventType.CREATE)
    assert entry is not None and entry.path == f"{work}/async.txt"
    assert exited == [None]
