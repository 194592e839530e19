"""Fixtures for the container runtime suite: real namespaces, cgroups and overlayfs.

The root filesystem layer is the base template (`aenv.devserver.base_layer`, built once per
machine), or $AENV_TEST_ROOTFS when set. Every sandbox, cgroup, network slot and workspace a
test makes is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import spec_for

from aenv.config import Config
from aenv.devserver import base_layer
from aenv.runtime.base import RuntimeHandle
from aenv.runtime.container.driver import ContainerDriver

CreateFn = Callable[..., Awaitable[RuntimeHandle]]


@pytest.fixture(scope="session")
def rootfs() -> Path:
    assert os.geteuid() == 0, "the container runtime suite needs root (namespaces, cgroups, mounts)"
    if "AENV_TEST_ROOTFS" in os.environ:
        return Path(os.environ["AENV_TEST_ROOTFS"])
    return base_layer()


@pytest.fixture(scope="session")
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-runtime-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_config(home: Path) -> Config:
    cfg = Config()
    cfg.server.home = home
    cfg.runtime.warm_pool = 2  # network slots
    return cfg


@pytest.fixture(scope="session")
async def driver(rootfs: Path, home: Path) -> AsyncIterator[ContainerDriver]:
    drv = ContainerDriver(make_config(home), warm_processes=4)
    await drv.start()
    yield drv
    await drv.close()
    # The bridge and nftables tables go too, unless another server on this host uses them.
    await drv.network.teardown()


@pytest.fixture
async def create(driver: ContainerDriver, rootfs: Path, home: Path
                 ) -> AsyncIterator[CreateFn]:
    """create(**spec_overrides) -> handle; everything created is destroyed afterwards."""
    made: list[tuple[ContainerDriver, RuntimeHandle]] = []

    async def _create(drv: ContainerDriver | None = None, **overrides: Any) -> RuntimeHandle:
        drv = drv or driver
        handle = await drv.create(spec_for(home, rootfs,
                                           **{"allow_internet_access": False, **overrides}))
        made.append((drv, handle))
        return handle

    yield _create
    for drv, handle in made:
        await drv.destroy(handle)
