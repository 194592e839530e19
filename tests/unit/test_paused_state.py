"""`PausedStateKeeper` against a real posix_fs repository: uploads after a pause, pulls back
what a resume misses, cancels an upload a resume overtakes, deletes entries afterwards.

The driver here is a stand-in for `PausedStateDriver` whose paused state is two plain
directories (the container driver's real one is covered end to end in
tests/e2e/test_pause_resume.py and tests/e2e/test_s3_repository.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from aenv.errors import AenvError, ErrorCode
from aenv.orchestrator import paused
from aenv.orchestrator.paused import PausedStateKeeper, entry_name
from aenv.runtime.base import PausedStateDriver, RuntimeHandle
from aenv.storage.repository.posix import PosixBlobStore
from aenv.storage.repository.repository import Repository


class TwoDirs:
    """Paused state = <root>/image and <root>/upper; prepare makes <root>."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prepared = 0

    def paused_state(self, handle: RuntimeHandle) -> dict[str, Path]:
        return {"p1-image": self.root / "image", "p1-upper": self.root / "upper"}

    async def prepare_paused_state(self, handle: RuntimeHandle) -> None:
        self.prepared += 1
        self.root.mkdir(parents=True, exist_ok=True)


HANDLE = RuntimeHandle("test", "sbx0000000000000001", {})


def fill(driver: TwoDirs) -> dict[str, bytes]:
    files = {"image/pages-1.img": os.urandom(300_000), "image/core-1.img": b"core",
             "upper/home/user/notes.txt": b"kept"}
    for rel, data in files.items():
        path = driver.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


@pytest.fixture
def repository(tmp_path: Path) -> Repository:
    return Repository(PosixBlobStore(tmp_path / "repo"), concurrency=4)


@pytest.fixture(autouse=True)
def no_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paused, "PERSIST_DELAY_S", 0.0)


async def settle(keeper: PausedStateKeeper) -> None:
    for _ in range(200):
        if not keeper._uploads and not keeper._deletes:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("background work did not finish")


async def test_the_driver_stand_in_is_a_paused_state_driver(tmp_path: Path) -> None:
    assert isinstance(TwoDirs(tmp_path), PausedStateDriver)


async def test_upload_then_a_resume_on_a_node_that_lost_everything(
        tmp_path: Path, repository: Repository) -> None:
    driver = TwoDirs(tmp_path / "ws")
    files = fill(driver)
    keeper = PausedStateKeeper(repository)
    keeper.persist_later(driver, HANDLE)
    await settle(keeper)
    assert sorted(await repository.list()) == sorted(
        entry_name(HANDLE.sandbox_id, n) for n in ("p1-image", "p1-upper"))

    await asyncio.to_thread(shutil.rmtree, driver.root)
    await keeper.ensure_local(driver, HANDLE)
    assert driver.prepared == 1
    for rel, data in files.items():
        assert (driver.root / rel).read_bytes() == data

    keeper.forget_later(driver, HANDLE)
    await settle(keeper)
    assert await repository.list() == []


async def test_nothing_missing_means_nothing_pulled(tmp_path: Path,
                                                   repository: Repository) -> None:
    driver = TwoDirs(tmp_path / "ws")
    fill(driver)
    keeper = PausedStateKeeper(repository)
    await keeper.ensure_local(driver, HANDLE)  # nothing was ever uploaded, nothing needed
    assert driver.prepared == 0


async def test_a_second_persist_uploads_only_what_is_missing(tmp_path: Path,
                                                            repository: Repository) -> None:
    driver = TwoDirs(tmp_path / "ws")
    fill(driver)
    keeper = PausedStateKeeper(repository)
    keeper.persist_later(driver, HANDLE)
    await settle(keeper)
    image_manifest = await repository.manifest(entry_name(HANDLE.sandbox_id, "p1-image"))
    keeper.persist_later(driver, HANDLE)  # what a restarted server does
    await settle(keeper)
    assert await repository.manifest(entry_name(HANDLE.sandbox_id, "p1-image")) == \
        image_manifest


async def test_a_resume_overtakes_the_upload(tmp_path: Path, repository: Repository,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paused, "PERSIST_DELAY_S", 30.0)
    driver = TwoDirs(tmp_path / "ws")
    fill(driver)
    keeper = PausedStateKeeper(repository)
    keeper.persist_later(driver, HANDLE)
    await keeper.ensure_local(driver, HANDLE)  # all local: the pending upload is cancelled
    await settle(keeper)
    assert await repository.list() == []


async def test_lost_locally_and_never_uploaded_is_a_clear_not_found(
        tmp_path: Path, repository: Repository) -> None:
    driver = TwoDirs(tmp_path / "ws")  # nothing on disk, nothing in the repository
    keeper = PausedStateKeeper(repository)
    with pytest.raises(AenvError) as err:
        await keeper.ensure_local(driver, HANDLE)
    assert err.value.code == ErrorCode.NOT_FOUND
    assert "never stored in the repository" in err.value.message


async def test_an_upload_that_fails_is_logged_not_raised(
        tmp_path: Path, repository: Repository, caplog: pytest.LogCaptureFixture) -> None:
    driver = TwoDirs(tmp_path / "ws")  # its directories do not exist
    keeper = PausedStateKeeper(repository)
    keeper.persist_later(driver, HANDLE)
    await settle(keeper)
    assert "copying its state to the repository failed" in caplog.text
    assert await repository.list() == []
