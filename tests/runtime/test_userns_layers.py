"""Container sandboxes in user namespaces (security.userns), below the API: how each kind of
lower layer is stacked, and what the sandbox's root may and may not do.

Layers holding host ids (a template's base and OCI layers, the driver's) are idmapped: host
uid 0 shows as the sandbox's root. A layer that already holds shifted ids (a sealed upper of
such a sandbox: its root directory is owned by host uid 1000000, `layers.stores_shifted_ids`)
is stacked as it is; idmapping it as well would show its files as nobody's. Each check has a
positive control (the same path seen from the host, or a layer of the other kind).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import CreateFn
from sandbox_helpers import run

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import checkpoint, layers
from aenv.runtime.container.driver import ContainerDriver

ROOT = 1_000_000


@pytest.fixture(scope="module")
async def userns_driver(home: Path) -> AsyncIterator[ContainerDriver]:
    cfg = Config()
    cfg.server.home = home / "userns"
    cfg.runtime.warm_pool = 1
    cfg.runtime.ready_pool = 0
    cfg.security.userns = True
    drv = ContainerDriver(cfg, warm_processes=2)
    await drv.start()
    yield drv
    await drv.close()


@pytest.fixture
def shifted_layer(home: Path) -> Path:
    """A layer as a sealed upper of a userns sandbox looks on disk: ids shifted by 1000000."""
    layer = home / "userns-sealed-layer"
    (layer / "srv").mkdir(parents=True, exist_ok=True)
    (layer / "srv" / "by-user.txt").write_text("made by uid 1000 inside\n")
    os.chown(layer / "srv" / "by-user.txt", ROOT + 1000, ROOT + 1000)
    os.chown(layer / "srv", ROOT, ROOT)
    os.chown(layer, ROOT, ROOT)
    return layer


@pytest.fixture
def host_layer(home: Path) -> Path:
    """A layer holding host ids (like an OCI layer): owner 1000 on disk."""
    layer = home / "host-id-layer"
    (layer / "opt").mkdir(parents=True, exist_ok=True)
    (layer / "opt" / "by-1000.txt").write_text("owned by 1000 on disk\n")
    os.chown(layer / "opt" / "by-1000.txt", 1000, 1000)
    return layer


async def test_each_layer_kind_shows_its_owners_inside(
        userns_driver: ContainerDriver, create: CreateFn, rootfs: Path, shifted_layer: Path,
        host_layer: Path) -> None:
    assert layers.stores_shifted_ids(shifted_layer, ROOT)
    assert not layers.stores_shifted_ids(host_layer, ROOT)
    assert not layers.stores_shifted_ids(rootfs, ROOT)
    h = await create(userns_driver, lower_layers=(shifted_layer, host_layer, rootfs))
    owners = await run(userns_driver, h,
                       "stat -c %u:%g /srv/by-user.txt /opt/by-1000.txt /bin/bash /")
    assert owners.stdout.split() == ["1000:1000", "1000:1000", "0:0", "0:0"], owners
    uid_map = await run(userns_driver, h, "cat /proc/self/uid_map")
    assert uid_map.stdout.split() == ["0", str(ROOT), "65536"]
    # What the sandbox writes lands shifted in its upper (not idmapped).
    await run(userns_driver, h, "echo x > /srv/new && chown 1000 /srv/new && touch /tmp/r")
    upper = Path(h.data["workspace"]) / "upper"
    assert (upper / "srv" / "new").stat().st_uid == ROOT + 1000
    assert (upper / "tmp" / "r").stat().st_uid == ROOT
    assert upper.stat().st_uid == ROOT  # a seal of it would be a shifted layer


async def test_root_has_no_capability_over_the_host_or_its_namespaces(
        userns_driver: ContainerDriver, create: CreateFn) -> None:
    h = await create(userns_driver, allow_internet_access=True)
    tries = {
        "mount": "mount -t tmpfs t /mnt",
        "hostname": "hostname evil",
        "mknod": "mknod /tmp/sda b 8 0",
        "ip": "ip link add dummy0 type dummy",
        "kernel-file": "echo 1 > /proc/sys/kernel/sysrq",
    }
    for what, cmd in tries.items():
        res = await run(userns_driver, h, f"{cmd} 2>&1; echo rc=$?")
        assert "rc=0" not in res.stdout, f"{what} succeeded as sandbox root: {res.stdout}"
        assert "not found" not in res.stdout, res.stdout  # refused, not missing
    # Positive control: root inside is root for what it owns.
    ok = await run(userns_driver, h, "touch /tmp/f && chown 1234:1234 /tmp/f && "
                   "stat -c %u /tmp/f && ls /root >/dev/null && echo ok")
    assert ok.stdout.split() == ["1234", "ok"], ok
    # The network slot still works for the unprivileged root: bind a low port.
    bound = await run(userns_driver, h, "python3 -c \"import socket; "
                      "socket.socket().bind(('0.0.0.0', 80)); print('bound')\"")
    assert bound.stdout.strip() == "bound", bound


async def test_checkpoints_are_refused_with_the_reason(userns_driver: ContainerDriver,
                                                       create: CreateFn, home: Path) -> None:
    h = await create(userns_driver)
    with pytest.raises(AenvError) as err:
        await userns_driver.snapshot(h, home / "userns-snapshot")
    assert err.value.code is ErrorCode.NOT_SUPPORTED
    assert err.value.message == checkpoint.USERNS_NOT_CHECKPOINTABLE
    assert (await run(userns_driver, h, "echo alive")).stdout.strip() == "alive"

