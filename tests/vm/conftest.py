"""Fixtures for the qemu runtime suite: a real `QemuDriver` booting microVMs.

Needs root, qemu-system-x86_64 and the guest artefacts (`make install` runs
scripts/install-vm.sh). Root disk images are cached per machine next to the test layer cache,
so only the first session pays for building one. Every VM a test makes is destroyed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vm_helpers import spec_for

from aenv.config import Config
from aenv.devserver import base_layer, layer_cache
from aenv.runtime.base import RuntimeHandle
from aenv.runtime.qemu.driver import QemuDriver

CreateFn = Callable[..., Awaitable[RuntimeHandle]]


@pytest.fixture(scope="session")
def rootfs() -> Path:
    assert os.geteuid() == 0, "the qemu runtime suite needs root (tap devices, namespaces)"
    return base_layer()


@pytest.fixture(scope="session")
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-vm-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_driver(home: Path) -> QemuDriver:
    cfg = Config()
    cfg.server.home = home
    cfg.runtime.warm_pool = 2
    return QemuDriver(cfg, disk_cache=layer_cache().parent / "vm-disks")


@pytest.fixture(scope="session")
async def driver(rootfs: Path, home: Path) -> AsyncIterator[QemuDriver]:
    drv = make_driver(home)
    await drv.start()
    yield drv
    await drv.close()


@pytest.fixture
async def create(driver: QemuDriver, rootfs: Path, home: Path) -> AsyncIterator[CreateFn]:
    """create(**spec_overrides) -> handle; everything created is destroyed afterwards."""
    made: list[RuntimeHandle] = []

    async def _create(**overrides: Any) -> RuntimeHandle:
        handle = await driver.create(spec_for(home, rootfs, **overrides))
        made.append(handle)
        return handle

    yield _create
    for handle in made:
        await driver.destroy(handle)
