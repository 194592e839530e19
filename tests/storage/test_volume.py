"""The managed btrfs volume of a home on a non-btrfs filesystem (storage/volume.py), for real:
a sparse image, loop-mounted; made once, reused while mounted (a server restart or `kill -9`),
mounted again from the same image after an unmount (a reboot), with the home's storage
directories as symlinks into it and the database left on the home's own filesystem."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime.container import linux
from aenv.storage.layout import Layout
from aenv.storage.volume import STORAGE_DIRS, attach_storage, btrfs_available, detach_storage

pytestmark = pytest.mark.skipif(not btrfs_available(), reason="needs mkfs.btrfs and loop devices")


@pytest.fixture
def ext4_home() -> Iterator[Path]:
    parent = Path(tempfile.mkdtemp(prefix="aenv-volume-test-", dir="/var/tmp"))
    home = parent / "home"
    home.mkdir(mode=0o700)
    assert not linux.on_btrfs(str(home)), "this test needs /var/tmp on a non-btrfs filesystem"
    try:
        yield home
    finally:
        detach_storage(home)
        for root, dirs, files in os.walk(parent, topdown=False):
            for name in files + dirs:
                path = Path(root) / name
                path.unlink() if path.is_symlink() or not path.is_dir() else path.rmdir()
        parent.rmdir()


def test_made_once_reused_and_remounted_after_a_reboot(ext4_home: Path) -> None:
    home = ext4_home
    (home / "layers").mkdir()
    (home / "layers" / "base-abc").symlink_to("/nonexistent/base")  # a test home's base link
    (home / "aenv.sqlite3").write_text("db")
    vol = attach_storage(home, "auto", size_gb=2)
    assert vol is not None and os.path.ismount(vol.mountpoint)
    assert linux.on_btrfs(str(vol.mountpoint))
    options = next(line.split()[3] for line in Path("/proc/self/mounts").read_text().splitlines()
                   if line.split()[1] == str(vol.mountpoint))
    assert {"nosuid", "nodev"} <= set(options.split(","))
    assert stat.S_IMODE(vol.image.stat().st_mode) == 0o600
    for name in STORAGE_DIRS:
        assert (home / name).is_symlink() and linux.on_btrfs(str(home / name))
    # What was in layers/ moved onto the volume; the database stayed on the host filesystem.
    assert os.readlink(home / "layers" / "base-abc") == "/nonexistent/base"
    assert not linux.on_btrfs(str(home / "aenv.sqlite3"))
    (home / "sandboxes" / "marker").write_text("kept")

    # A restart (the volume still mounted): the same filesystem, nothing made again.
    inode = vol.image.stat().st_ino
    assert attach_storage(home, "auto", size_gb=2) == vol
    assert vol.image.stat().st_ino == inode

    # A reboot (unmounted): the symlinks dangle until the server's start (in its order)
    # mounts the same image again, contents intact.
    detach_storage(home)
    assert not os.path.ismount(vol.mountpoint) and not (home / "sandboxes").exists()
    layout = Layout(home)
    layout.ensure_home()
    assert attach_storage(home, "auto", size_gb=2) == vol
    layout.ensure()
    assert (home / "sandboxes" / "marker").read_text() == "kept"
    assert all(linux.on_btrfs(str(home / name)) for name in STORAGE_DIRS)


def test_off_and_homes_with_sandboxes_of_their_own_stay_on_the_host(ext4_home: Path) -> None:
    home = ext4_home
    assert attach_storage(home, "off") is None
    (home / "sandboxes" / "old-sandbox").mkdir(parents=True)
    assert attach_storage(home, "auto", size_gb=2) is None
    assert not (home / "volume.img").exists() and not (home / "sandboxes").is_symlink()
    with pytest.raises(Exception, match="neither 'auto' nor 'off'"):
        attach_storage(home, "yes")
