"""Fixtures for the image suite: real `docker-registry` processes on loopback (one open, one
behind htpasswd basic auth) and an `ImagePuller` on a private AENV_HOME per test.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from oci_helpers import AUTH, Registry

from aenv.config import Config
from aenv.images.pull import ImagePuller
from aenv.orchestrator.store import Store
from aenv.storage.layout import Layout


@pytest.fixture(scope="session")
def registry() -> Iterator[Registry]:
    if shutil.which("docker-registry") is None:
        pytest.fail("docker-registry is not installed: run `make install`")
    root = Path(tempfile.mkdtemp(prefix="aenv-registry-"))
    reg = Registry(root).start()
    yield reg
    reg.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[Registry]:
    root = Path(tempfile.mkdtemp(prefix="aenv-registry-auth-"))
    reg = Registry(root, auth=AUTH).start()
    yield reg
    reg.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    cfg = Config()
    cfg.server.home = tmp_path / "home"
    cfg.images.retries = 3
    return cfg


@pytest.fixture
def layout(config: Config) -> Layout:
    lay = Layout(config.home)
    lay.ensure()
    return lay


@pytest.fixture
def store(layout: Layout) -> Iterator[Store]:
    st = Store(layout.database)
    yield st
    st.close()


@pytest.fixture
def puller(config: Config, layout: Layout, store: Store) -> ImagePuller:
    return ImagePuller(config, layout, store)
