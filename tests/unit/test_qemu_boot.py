"""The qemu runtime's pure parts: command lines, accelerator choice, the initramfs archive."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from aenv.config import load_config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime.qemu import artefacts, boot

needs_qemu = pytest.mark.skipif(shutil.which(boot.QEMU) is None, reason="qemu not installed")


def test_kernel_cmdline_pins_the_tsc_and_carries_no_secret() -> None:
    line = boot.kernel_cmdline()
    assert f"tsc_early_khz={boot.tsc_khz()}" in line and boot.tsc_khz() > 0
    assert "aenv.ip=192.0.2.2/30" in line and "aenv.gw=192.0.2.1" in line
    for broken in ("acpi=off", "pit=off", "pic=off"):  # these break Debian's kernel
        assert broken not in line
    assert "aenv.probe=1" in boot.kernel_cmdline(probe=True)


@needs_qemu
def test_qemu_argv(tmp_path: Path) -> None:
    paths = boot.VmPaths(tmp_path)
    cfg = boot.VmConfig(artefacts=artefacts.Artefacts(tmp_path), accel="tcg", cpus=2,
                        memory_mb=512, paths=paths, ram_path=tmp_path / "r.ram",
                        ram_shared=False, extra=["-S", "-incoming", "defer"])
    argv = boot.qemu_argv(cfg)
    joined = " ".join(argv)
    assert argv[argv.index("-M") + 1].startswith("microvm")
    assert "tcg,thread=multi" in joined and "-cpu max" in joined
    assert f"mem-path={tmp_path}/r.ram,share=off" in joined
    assert "virtio-balloon-device,free-page-reporting=on" in joined
    assert "virtserialport,chardev=ctl,name=aenv.ctl" in joined
    assert "-daemonize" in argv and argv[-2:] == ["-incoming", "defer"]
    kvm = boot.qemu_argv(boot.VmConfig(artefacts=artefacts.Artefacts(tmp_path), accel="kvm",
                                       cpus=1, memory_mb=256, paths=paths, ram_path=None))
    assert "-cpu" not in kvm  # -cpu host aborts on nested KVM (MSR 0x10a)


@needs_qemu
def test_accelerator_setting(tmp_path: Path) -> None:
    art = artefacts.Artefacts(tmp_path)
    cache = tmp_path / "accel.json"
    assert asyncio.run(boot.choose_accel("tcg", art, cache)) == ("tcg", "configured")
    with pytest.raises(AenvError) as exc:
        asyncio.run(boot.choose_accel("hvf", art, cache))
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert load_config({"AENV_RUNTIME_QEMU_ACCEL": "kvm"}, path=tmp_path / "none.toml"
                       ).runtime.qemu_accel == "kvm"


def test_initramfs_is_a_newc_archive(tmp_path: Path) -> None:
    mods = tmp_path / "modules"
    mods.mkdir()
    for name in artefacts.MODULES:
        (mods / f"{name}.ko").write_bytes(b"\x7fELF" + name.encode())
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"#!busybox")
    raw = artefacts.build_initramfs(mods, busybox)
    names: dict[str, tuple[int, bytes]] = {}
    off = 0
    while True:
        head = raw[off:off + 110]
        assert head[:6] == b"070701"
        fields = [int(head[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
        mode, size, namesize = fields[1], fields[6], fields[11]
        name_end = off + 110 + namesize
        name = raw[off + 110:name_end - 1].decode()
        data_at = name_end + (-name_end % 4)
        names[name] = (mode, raw[data_at:data_at + size])
        off = data_at + size + (-(data_at + size) % 4)
        if name == "TRAILER!!!":
            break
    assert off == len(raw)
    assert names["init"][1].startswith(b"#!/bin/sh") and names["init"][0] & 0o111
    assert names["dev/console"][0] & 0o170000 == 0o020000  # a character device
    assert names["bin/sh"] == (0o120777, b"busybox")  # symlinks to busybox
    assert names["lib/modules/virtio_mmio.ko"][1] == b"\x7fELFvirtio_mmio"
    script = names["init"][1].decode()
    # Modules load in dependency order.
    order = [script.index(m) for m in ("virtio_ring", "virtio_mmio", "virtio_blk", "virtio_net")]
    assert order == sorted(order)


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-img not installed")
def test_qcow2_backing_is_read_from_the_header(tmp_path: Path) -> None:
    """What `qemu-img` wrote, read back without it; a rebase to the same base is skipped
    and one to another base is done."""
    from aenv.runtime.qemu import images

    base, other = tmp_path / "base.img", tmp_path / "other.img"
    for path in (base, other):
        path.write_bytes(b"\0" * 2**20)
    overlay = tmp_path / "disk.qcow2"
    asyncio.run(images.create_overlay(base, overlay))
    assert images.qcow2_backing(overlay) == (str(base), "raw")
    stamp = overlay.stat().st_mtime_ns
    asyncio.run(images.point_overlay_at(overlay, base))
    assert overlay.stat().st_mtime_ns == stamp  # already right: untouched
    asyncio.run(images.point_overlay_at(overlay, other))
    assert images.qcow2_backing(overlay) == (str(other), "raw")
    asyncio.run(images.run("qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "plain"),
                           "1M"))
    assert images.qcow2_backing(tmp_path / "plain") == (None, None)
    with pytest.raises(ValueError, match="not a qcow2"):
        images.qcow2_backing(base)
