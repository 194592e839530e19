"""Sealed overlay layers (`aenv.runtime.container.layers`): merging a stack of them gives one
layer with the same view, checked by mounting overlayfs over both stacks; on a plain
filesystem (copies) and on btrfs (subvolume snapshots)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime.container import layers, linux
from aenv.storage.volume import btrfs_available, mount_btrfs_volume, unmount_volume


def _whiteout(path: Path) -> None:
    os.mknod(path, 0o600 | stat.S_IFCHR, 0)


def _view(lower: list[Path], mountpoint: Path) -> dict[str, str]:
    """Every path of the merged view with its type and content (files)."""
    mountpoint.mkdir()
    linux.mount("overlay", str(mountpoint), "overlay", linux.MS_RDONLY,
                "lowerdir=" + ":".join(map(str, lower)))
    try:
        out = {}
        for root, dirs, files in os.walk(mountpoint):
            for name in dirs + files:
                p = Path(root) / name
                rel = str(p.relative_to(mountpoint))
                if p.is_symlink():
                    out[rel] = "-> " + os.readlink(p)
                elif p.is_dir():
                    out[rel] = f"dir {stat.S_IMODE(p.stat().st_mode):o}"
                else:
                    out[rel] = p.read_text()
        return out
    finally:
        linux.umount2(str(mountpoint), linux.MNT_DETACH)


@pytest.fixture(params=["plain", "btrfs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "btrfs":
        if not btrfs_available():
            pytest.skip("mkfs.btrfs or loop devices missing (make install)")
        mount_btrfs_volume(tmp_path, 2 << 30)
        try:
            yield tmp_path
        finally:
            unmount_volume(tmp_path)
    else:
        yield tmp_path


def _sealed(root: Path, name: str) -> Path:
    """A writable layer as the runtime makes them: a subvolume on btrfs, a directory
    elsewhere."""
    path = root / name
    if linux.on_btrfs(str(root)):
        linux.subvolume_create(str(path))
    else:
        path.mkdir()
    return path


def test_merging_sealed_layers_keeps_the_view(root: Path) -> None:
    base = root / "base"  # a template layer: stays under the merged one
    (base / "d").mkdir(parents=True)
    (base / "d/a").write_text("base a")
    (base / "gone").write_text("deleted above")
    (base / "od").mkdir()
    (base / "od/hidden").write_text("hidden by an opaque dir")
    (base / "keep").write_text("kept")
    s1 = _sealed(root, "s1")  # bottom sealed layer
    (s1 / "d").mkdir()
    (s1 / "d/b").write_text("s1 b")
    _whiteout(s1 / "gone")
    (s1 / "new1").write_text("added then deleted")
    (s1 / "link").symlink_to("d/b")
    s2 = _sealed(root, "s2")
    (s2 / "d").mkdir()
    (s2 / "d/a").write_text("s2 rewrote a")
    _whiteout(s2 / "new1")
    (s2 / "od").mkdir()
    os.setxattr(s2 / "od", layers.OPAQUE_XATTR, b"y")
    (s2 / "od/only").write_text("only this")
    s3 = _sealed(root, "s3")
    (s3 / "new1").write_text("back again")  # over the whiteout of s2
    (s3 / "d").mkdir(mode=0o700)
    os.chmod(s3 / "d", 0o700)
    stack = [s3, s2, s1]
    before = _view([*stack, base], root / "m1")
    merged = root / "merged"
    layers.merge_layers(stack, merged)
    after = _view([merged, base], root / "m2")
    assert after == before
    assert before["new1"] == "back again" and "gone" not in before
    assert "od/hidden" not in before and before["d/a"] == "s2 rewrote a"
    assert before["d"] == "dir 700"
    if linux.on_btrfs(str(root)):
        assert linux.is_subvolume(str(merged))
        with pytest.raises(OSError):
            (merged / "x").write_text("read-only")
    assert not any(p.name.startswith(".merge-") for p in root.iterdir())  # no leftovers
    layers.remove_layer(merged)
    assert not merged.exists()
    # The inputs are untouched.
    assert _view([*stack, base], root / "m3") == before
