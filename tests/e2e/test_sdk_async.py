"""The official `e2b` SDK (`AsyncSandbox`), unmodified, against a real `aenv serve`."""

from __future__ import annotations

import asyncio
import io
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import pytest_asyncio
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileNotFoundException,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    PtySize,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

ENV_NAME = "AENV_E2E_ASYNC"


async def async_wait_until(predicate: Callable[[], Any | Awaitable[Any]], timeout: float,
                           interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


async def list_ids(query: SandboxQuery, limit: int | None = None) -> list[str]:
    paginator = AsyncSandbox.list(query=query, limit=limit)
    ids: list[str] = []
    while paginator.has_next:
        ids += [s.sandbox_id for s in await paginator.next_items()]
    return ids


@pytest.fixture(scope="module")
def asbx_meta() -> dict[str, str]:
    return {"suite": "e2e-async", "owner": uuid.uuid4().hex[:10]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def asbx(asbx_meta: dict[str, str]) -> AsyncIterator[AsyncSandbox]:
    sandbox = await AsyncSandbox.create(metadata=asbx_meta, envs={ENV_NAME: "async-env"},
                                        timeout=600)
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def test_create_metadata_envs(asbx: AsyncSandbox, asbx_meta: dict[str, str]) -> None:
    info = await asbx.get_info()
    assert info.sandbox_id == asbx.sandbox_id
    assert info.metadata == asbx_meta
    assert info.state == SandboxState.RUNNING
    assert (await asbx.commands.run(f"echo ${ENV_NAME}")).stdout == "async-env\n"
    assert await asbx.is_running() is True


async def test_run_output_exit_user_cwd(asbx: AsyncSandbox) -> None:
    res = await asbx.commands.run("echo out; echo err >&2")
    assert (res.stdout, res.stderr, res.exit_code) == ("out\n", "err\n", 0)

    with pytest.raises(CommandExitException) as exc_info:
        await asbx.commands.run("echo before; exit 42")
    assert exc_info.value.exit_code == 42
    assert exc_info.value.stdout == "before\n"

    res = await asbx.commands.run('echo "$A"; pwd; id -u', envs={"A": "from-envs"}, cwd="/var")
    assert res.stdout.split() == ["from-envs", "/var", "1000"]
    assert (await asbx.commands.run("id -u", user="root")).stdout == "0\n"


async def test_concurrent_commands_in_one_sandbox(asbx: AsyncSandbox) -> None:
    results = await asyncio.gather(*(asbx.commands.run(f"sleep 0.3; echo n{i}")
                                     for i in range(10)))
    assert [r.stdout for r in results] == [f"n{i}\n" for i in range(10)]


async def test_timeout(asbx: AsyncSandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        await asbx.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - started < 20


async def test_background_connect_stdin_kill(asbx: AsyncSandbox) -> None:
    first: list[str] = []
    handle = await asbx.commands.run('while read -r line; do echo "echo:$line"; done',
                                     background=True, stdin=True, on_stdout=first.append)
    pid = handle.pid
    try:
        assert pid in {p.pid for p in await asbx.commands.list()}
        await asbx.commands.send_stdin(pid, "one\n")
        await async_wait_until(lambda: "echo:one\n" in "".join(first), 10, what="echo:one")

        await handle.disconnect()
        second: list[str] = []
        again = await asbx.commands.connect(pid, on_stdout=second.append, timeout=30)
        await asbx.commands.send_stdin(pid, "two\n")
        await async_wait_until(lambda: "echo:two\n" in "".join(second), 10, what="echo:two")
        assert "echo:one" not in "".join(second)  # live output only after connecting

        assert await asbx.commands.kill(pid) is True
        with pytest.raises(CommandExitException) as exc_info:
            await again.wait()
        assert exc_info.value.exit_code != 0
        await async_wait_until(
            lambda: _pid_gone(asbx, pid), 10, what="the killed process to leave the list")
        assert await asbx.commands.kill(pid) is False
    finally:
        await asbx.commands.kill(pid)


async def _pid_gone(asbx: AsyncSandbox, pid: int) -> bool:
    return pid not in {p.pid for p in await asbx.commands.list()}


async def test_pty(asbx: AsyncSandbox) -> None:
    buf = bytearray()
    handle = await asbx.pty.create(PtySize(rows=30, cols=90), on_data=buf.extend, timeout=60)

    def size(tag: str) -> tuple[int, int] | None:
        m = re.search(tag + r":(\d+) (\d+)", buf.decode(errors="replace"))
        return (int(m.group(1)), int(m.group(2))) if m else None

    try:
        await asbx.pty.send_stdin(handle.pid, b"stty size | sed 's/^/SZA:/'\n")
        assert await async_wait_until(lambda: size("SZA"), 15, what="stty output") == (30, 90)
        await asbx.pty.resize(handle.pid, PtySize(rows=50, cols=132))
        await asbx.pty.send_stdin(handle.pid, b"stty size | sed 's/^/SZB:/'\n")
        assert await async_wait_until(lambda: size("SZB"), 15, what="stty output") == (50, 132)
    finally:
        killed = await asbx.pty.kill(handle.pid)
    assert killed is True
    with pytest.raises(CommandExitException):
        await asyncio.wait_for(handle.wait(), 15)


async def test_files(asbx: AsyncSandbox) -> None:
    base = f"/home/user/e2e-async-{uuid.uuid4().hex[:8]}"
    info = await asbx.files.write(f"{base}/t.txt", "text")
    assert (info.path, info.name) == (f"{base}/t.txt", "t.txt")
    assert await asbx.files.read(f"{base}/t.txt") == "text"

    data = bytes(range(256)) * 10
    await asbx.files.write(f"{base}/b.bin", data)
    assert bytes(await asbx.files.read(f"{base}/b.bin", format="bytes")) == data

    big = uuid.uuid4().bytes * 100_000
    await asbx.files.write(f"{base}/s.bin", io.BytesIO(big))
    stream = await asbx.files.read(f"{base}/s.bin", format="stream")
    chunks = [chunk async for chunk in stream]
    assert b"".join(chunks) == big

    infos = await asbx.files.write_files([{"path": f"{base}/m/{i}.txt", "data": str(i)}
                                         for i in range(4)])
    assert sorted(i.path for i in infos) == [f"{base}/m/{i}.txt" for i in range(4)]
    listed = await asbx.files.list(f"{base}/m")
    assert sorted(e.name for e in listed) == [f"{i}.txt" for i in range(4)]
    deep = {e.path for e in await asbx.files.list(base, depth=2)}
    assert f"{base}/m/3.txt" in deep and f"{base}/t.txt" in deep

    assert await asbx.files.exists(f"{base}/t.txt") is True
    assert (await asbx.files.get_info(f"{base}/t.txt")).size == 4
    assert (await asbx.files.rename(f"{base}/t.txt", f"{base}/u.txt")).path == f"{base}/u.txt"
    assert await asbx.files.exists(f"{base}/t.txt") is False
    await asbx.files.remove(f"{base}/u.txt")
    assert await asbx.files.exists(f"{base}/u.txt") is False
    assert await asbx.files.make_dir(f"{base}/newdir/x") is True
    assert (await asbx.files.get_info(f"{base}/newdir/x")).type == FileType.DIR
    with pytest.raises(FileNotFoundException):
        await asbx.files.read(f"{base}/nope")


async def test_watch_dir_streaming(asbx: AsyncSandbox) -> None:
    base = f"/home/user/e2e-awatch-{uuid.uuid4().hex[:8]}"
    await asbx.files.make_dir(base)
    events: list[FilesystemEvent] = []
    exits: list[Exception | None] = []
    handle = await asbx.files.watch_dir(base, on_event=events.append, on_exit=exits.append,
                                        timeout=60, recursive=True)
    try:
        await asbx.files.write(f"{base}/a.txt", "a")
        await asbx.files.make_dir(f"{base}/sub")
        await asyncio.sleep(0.3)  # let the recursive watch pick up the new directory
        await asbx.files.write(f"{base}/sub/b.txt", "b")
        await asbx.files.remove(f"{base}/a.txt")

        def seen() -> bool:
            kinds = {(e.name, e.type) for e in events}
            return {("a.txt", FilesystemEventType.CREATE), ("a.txt", FilesystemEventType.REMOVE),
                    ("sub", FilesystemEventType.CREATE)} <= kinds and any(
                e.name.endswith("b.txt") for e in events)

        await async_wait_until(seen, 15, what="watch events")
        assert any(e.name == "sub/b.txt" for e in events), [e.name for e in events]
    finally:
        await handle.stop()
    assert exits == [None]  # stop() ends the watch cleanly, once
    count = len(events)
    await asbx.files.write(f"{base}/after-stop.txt", "x")
    await asyncio.sleep(0.5)
    assert len(events) == count


async def test_create_many_list_page_kill(run_id: str) -> None:
    meta = {"e2e-async-list": run_id}
    results = await asyncio.gather(*(AsyncSandbox.create(metadata={**meta, "i": str(i)},
                                                         timeout=120) for i in range(3)),
                                   return_exceptions=True)
    sandboxes = [r for r in results if isinstance(r, AsyncSandbox)]
    try:
        errors = [r for r in results if not isinstance(r, AsyncSandbox)]
        assert not errors, f"creates failed: {errors!r}"
        outs = await asyncio.gather(*(s.commands.run("hostname") for s in sandboxes))
        assert [o.stdout.strip() for o in outs] == [s.sandbox_id for s in sandboxes]

        paginator = AsyncSandbox.list(query=SandboxQuery(metadata=meta), limit=2)
        pages = []
        while paginator.has_next:
            pages.append(await paginator.next_items())
        assert [len(p) for p in pages] == [2, 1]
        assert {s.sandbox_id for p in pages for s in p} == {s.sandbox_id for s in sandboxes}
        assert await list_ids(SandboxQuery(metadata=meta, state=[SandboxState.PAUSED])) == []
        assert await list_ids(SandboxQuery(metadata={**meta, "i": "1"})) == [sandboxes[1].sandbox_id]

        # connect from a fresh object
        other = await AsyncSandbox.connect(sandboxes[0].sandbox_id)
        assert (await other.commands.run("echo via-connect")).stdout == "via-connect\n"
    finally:
        killed = await asyncio.gather(*(s.kill() for s in sandboxes))
    assert killed == [True, True, True]
    assert await AsyncSandbox.kill(sandboxes[0].sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.get_info(sandboxes[0].sandbox_id)
    assert await list_ids(SandboxQuery(metadata=meta)) == []


async def test_set_timeout_expiry(run_id: str) -> None:
    meta = {"e2e-async-expiry": run_id}
    s = await AsyncSandbox.create(metadata=meta, timeout=60)
    try:
        await s.set_timeout(1)
        end = (await s.get_info()).end_at
        assert end - datetime.now(UTC) < timedelta(seconds=3)
        await async_wait_until(
            lambda: _not_running(meta), 15, interval=0.5, what="expiry")
        assert await s.is_running() is False
    finally:
        await s.kill()


async def _not_running(meta: dict[str, str]) -> bool:
    return await list_ids(SandboxQuery(metadata=meta, state=[SandboxState.RUNNING])) == []
