"""The official `e2b` SDK (sync `Sandbox`), unmodified, against a real `aenv serve`.

Most tests share one module-scoped sandbox (`sbx`) and use unique paths; tests that change a
sandbox's lifecycle create their own and remove it in `finally`.
"""

from __future__ import annotations

import io
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from e2b import (
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    PtySize,
    Sandbox,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2e_helpers import wait_until

SBX_ENV = "AENV_E2E_VAR"
SBX_ENV_VALUE = "hello from envVars"


@pytest.fixture(scope="module")
def sbx_meta() -> dict[str, str]:
    return {"suite": "e2e-sync", "owner": uuid.uuid4().hex[:10]}


@pytest.fixture(scope="module")
def sbx(sbx_meta: dict[str, str]) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(metadata=sbx_meta, envs={SBX_ENV: SBX_ENV_VALUE}, timeout=600)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _ids(query: SandboxQuery, limit: int | None = None) -> list[str]:
    """All sandbox ids matching `query`, following every page."""
    paginator = Sandbox.list(query=query, limit=limit)
    ids: list[str] = []
    while paginator.has_next:
        ids += [s.sandbox_id for s in paginator.next_items()]
    return ids


# ------------------------------------------------------------------ create / info / envs


def test_create_metadata_and_envs_visible(sbx: Sandbox, sbx_meta: dict[str, str]) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.metadata == sbx_meta
    assert info.state == SandboxState.RUNNING
    assert "base" in (info.template_id, info.name)
    assert info.end_at > info.started_at
    # timeout=600 was asked for: the end is about 10 minutes after the start
    assert timedelta(seconds=500) < info.end_at - info.started_at < timedelta(seconds=700)
    assert info.cpu_count >= 1 and info.memory_mb >= 128

    assert sbx.commands.run(f"echo ${SBX_ENV}").stdout == SBX_ENV_VALUE + "\n"
    # a command's own envs win over the sandbox-wide ones
    res = sbx.commands.run(f"echo ${SBX_ENV}", envs={SBX_ENV: "overridden"})
    assert res.stdout == "overridden\n"


def test_is_running(sbx: Sandbox) -> None:
    assert sbx.is_running() is True


# ------------------------------------------------------------------ commands


def test_run_stdout_and_stderr(sbx: Sandbox) -> None:
    res = sbx.commands.run("echo to-out; echo to-err >&2; printf 'no newline'")
    assert res.exit_code == 0
    assert res.stdout == "to-out\nno newline"
    assert res.stderr == "to-err\n"


def test_run_callbacks_receive_output(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo line$i; done; echo oops >&2",
                     on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "line1\nline2\nline3\n"
    assert "".join(err) == "oops\n"


def test_large_output_arrives_intact(sbx: Sandbox) -> None:
    res = sbx.commands.run("seq 1 300000; seq 1 1000 >&2")
    lines = res.stdout.splitlines()
    assert len(lines) == 300000 and lines[0] == "1" and lines[-1] == "300000"
    assert res.stdout == "".join(f"{i}\n" for i in range(1, 300001))
    assert res.stderr.splitlines()[-1] == "1000"
    # multi-byte characters split across chunks are decoded correctly
    res = sbx.commands.run("python3 -c \"import sys; sys.stdout.write('é€𝄞' * 50000)\"")
    assert res.stdout == "é€𝄞" * 50000


def test_nonzero_exit_raises_command_exit(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as exc_info:
        sbx.commands.run("echo partial; echo bad >&2; exit 7")
    exc = exc_info.value
    assert exc.exit_code == 7
    assert exc.stdout == "partial\n"
    assert exc.stderr == "bad\n"


def test_envs_and_cwd(sbx: Sandbox) -> None:
    res = sbx.commands.run('echo "$FOO-$BAR"; pwd', envs={"FOO": "a b", "BAR": "c"}, cwd="/tmp")
    assert res.stdout == "a b-c\n/tmp\n"


def test_default_user_and_root(sbx: Sandbox) -> None:
    res = sbx.commands.run('id -u; whoami; echo "$HOME"; pwd')
    assert res.stdout.split() == ["1000", "user", "/home/user", "/home/user"]
    res = sbx.commands.run("id -u; whoami", user="root")
    assert res.stdout.split() == ["0", "root"]


def test_command_timeout_raises_and_kills(sbx: Sandbox) -> None:
    marker = f"sleep-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run(f"exec -a {marker} sleep 60", timeout=2)
    assert time.monotonic() - started < 20
    # the command's lifetime was the timeout: the process is gone, not left running
    wait_until(lambda: marker not in sbx.commands.run("ps -eo args").stdout, 10,
               what="the timed-out process to be killed")


def test_background_connect_send_stdin_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run('read -r line; echo "got:$line"; sleep 120',
                              background=True, stdin=True)
    pid = handle.pid
    assert isinstance(pid, int) and pid > 0
    try:
        procs = {p.pid: p for p in sbx.commands.list()}
        assert pid in procs
        assert procs[pid].cmd == "/bin/bash"
        assert any("read -r line" in a for a in procs[pid].args)

        # dropping the stream must not kill the process; connecting again sees live output
        handle.disconnect()
        assert pid in {p.pid for p in sbx.commands.list()}
        again = sbx.commands.connect(pid, timeout=30)
        assert again.pid == pid
        sbx.commands.send_stdin(pid, "ping\n")
        seen = ""
        for stdout, _stderr, _pty in again:
            seen += stdout or ""
            if "got:ping" in seen:
                break
        assert seen == "got:ping\n"

        assert sbx.commands.kill(pid) is True
        with pytest.raises(CommandExitException) as exc_info:
            again.wait()
        assert exc_info.value.exit_code != 0
        wait_until(lambda: pid not in {p.pid for p in sbx.commands.list()}, 10,
                   what="the killed process to leave the list")
        assert sbx.commands.kill(pid) is False
    finally:
        sbx.commands.kill(pid)


def test_background_wait_collects_output(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 0.5; echo done-bg; exit 4", background=True)
    with pytest.raises(CommandExitException) as exc_info:
        handle.wait()
    assert exc_info.value.exit_code == 4
    assert exc_info.value.stdout == "done-bg\n"


def test_kill_unknown_pid_is_false(sbx: Sandbox) -> None:
    assert sbx.commands.kill(999_999) is False


def test_stdin_then_close_stdin(sbx: Sandbox) -> None:
    handle = sbx.commands.run("tr a-z A-Z", background=True, stdin=True, timeout=30)
    handle.send_stdin("hello ")
    sbx.commands.send_stdin(handle.pid, b"world\n")
    handle.close_stdin()  # EOF: `tr` finishes
    assert handle.wait().stdout == "HELLO WORLD\n"


def test_metrics(sbx: Sandbox) -> None:
    info = sbx.get_info()
    metrics = sbx.get_metrics()
    assert metrics, "at least the current sample"
    last = metrics[-1]
    assert last.cpu_count == info.cpu_count
    assert last.mem_total == info.memory_mb * 1024 * 1024
    assert 0 < last.mem_used <= last.mem_total
    assert 0 <= last.cpu_used_pct
    assert abs((last.timestamp - datetime.now(UTC)).total_seconds()) < 60


# ------------------------------------------------------------------ pty


def test_pty_create_input_resize_kill(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    buf = bytearray()
    lock = threading.Lock()

    def reader() -> None:
        for _stdout, _stderr, pty in handle:  # ends when the pty process ends
            if pty:
                with lock:
                    buf.extend(pty)

    t = threading.Thread(target=reader, daemon=True)
    t.start()

    def size_report(tag: str) -> tuple[int, int] | None:
        with lock:
            text = buf.decode(errors="replace")
        m = re.search(tag + r":(\d+) (\d+)", text)
        return (int(m.group(1)), int(m.group(2))) if m else None

    try:
        # The typed line is echoed back; the pattern only matches the command's output.
        sbx.pty.send_stdin(handle.pid, b"stty size | sed 's/^/SZA:/'\n")
        assert wait_until(lambda: size_report("SZA"), 15, what="stty output") == (24, 80)
        sbx.pty.resize(handle.pid, PtySize(rows=40, cols=120))
        sbx.pty.send_stdin(handle.pid, b"stty size | sed 's/^/SZB:/'\n")
        assert wait_until(lambda: size_report("SZB"), 15, what="stty output") == (40, 120)
        sbx.pty.send_stdin(handle.pid, b"tty | sed 's/^/TTY:/'\n")
        assert wait_until(lambda: re.search(r"TTY:/dev/pts/\d+", buf.decode(errors="replace")),
                          15, what="tty output")
    finally:
        killed = sbx.pty.kill(handle.pid)
    assert killed is True
    t.join(15)
    assert not t.is_alive(), "the pty stream did not end after kill"
    assert sbx.pty.kill(handle.pid) is False


# ------------------------------------------------------------------ files


def test_files_write_read_text_bytes_stream(sbx: Sandbox) -> None:
    base = f"/home/user/e2e-{uuid.uuid4().hex[:8]}"
    info = sbx.files.write(f"{base}/text.txt", "héllo wörld\n")
    assert info.path == f"{base}/text.txt"
    assert info.name == "text.txt"
    assert info.type == FileType.FILE
    assert sbx.files.read(f"{base}/text.txt") == "héllo wörld\n"
    assert sbx.commands.run(f"cat {base}/text.txt").stdout == "héllo wörld\n"

    blob = bytes(range(256)) * 64
    sbx.files.write(f"{base}/blob.bin", blob)
    assert bytes(sbx.files.read(f"{base}/blob.bin", format="bytes")) == blob

    big = uuid.uuid4().bytes * 200_000  # 3.2 MB, streamed both ways
    sbx.files.write(f"{base}/stream.bin", io.BytesIO(big))
    with sbx.files.read(f"{base}/stream.bin", format="stream") as stream:
        got = b"".join(stream)
    assert got == big
    assert sbx.commands.run(f"stat -c %s {base}/stream.bin").stdout.strip() == str(len(big))

    # overwrite, and a relative path resolves against the user's home
    sbx.files.write(f"{base}/text.txt", "second")
    assert sbx.files.read(f"{base}/text.txt") == "second"
    rel = f"rel-{uuid.uuid4().hex[:8]}.txt"
    assert sbx.files.write(rel, "relative").path == f"/home/user/{rel}"
    assert sbx.commands.run(f"cat /home/user/{rel}").stdout == "relative"

    # gzip both ways, and file metadata (envd >= 0.6.2)
    sbx.files.write(f"{base}/gz.txt", "compressed " * 1000, gzip=True)
    assert sbx.files.read(f"{base}/gz.txt", gzip=True) == "compressed " * 1000
    assert sbx.commands.run(f"wc -c < {base}/gz.txt").stdout.strip() == str(11 * 1000)
    written = sbx.files.write(f"{base}/meta.txt", "m", metadata={"Origin": "e2e", "n": "1"})
    assert written.metadata == {"origin": "e2e", "n": "1"}
    assert sbx.files.get_info(f"{base}/meta.txt").metadata == {"origin": "e2e", "n": "1"}

    # files written as the default user belong to it
    assert sbx.files.get_info(f"{base}/text.txt").owner == "user"
    # and as root when asked
    root_file = f"/root/e2e-{uuid.uuid4().hex[:6]}.txt"
    assert sbx.files.write(root_file, "r", user="root").path == root_file
    assert sbx.files.get_info(root_file, user="root").owner == "root"
    assert sbx.commands.run(f"cat {root_file}", user="root").stdout == "r"


def test_files_write_files_many(sbx: Sandbox) -> None:
    base = f"/home/user/e2e-many-{uuid.uuid4().hex[:8]}"
    entries = [{"path": f"{base}/f{i}.txt", "data": f"content {i}"} for i in range(5)]
    entries.append({"path": f"{base}/nested/deep/bin.dat", "data": b"\x00\x01\x02"})
    infos = sbx.files.write_files(entries)
    assert sorted(i.path for i in infos) == sorted(e["path"] for e in entries)
    for i in range(5):
        assert sbx.files.read(f"{base}/f{i}.txt") == f"content {i}"
    assert bytes(sbx.files.read(f"{base}/nested/deep/bin.dat", format="bytes")) == b"\x00\x01\x02"


def test_files_list_exists_info_remove_rename_make_dir(sbx: Sandbox) -> None:
    base = f"/home/user/e2e-fs-{uuid.uuid4().hex[:8]}"
    assert sbx.files.make_dir(base) is True
    assert sbx.files.make_dir(base) is False
    assert sbx.files.get_info(base).type == FileType.DIR
    sbx.files.write(f"{base}/a.txt", "12345")
    sbx.files.write(f"{base}/sub/b.txt", "b")
    sbx.files.write(f"{base}/sub/subsub/c.txt", "c")

    level1 = {e.name: e for e in sbx.files.list(base)}
    assert set(level1) == {"a.txt", "sub"}
    assert level1["a.txt"].type == FileType.FILE
    assert level1["sub"].type == FileType.DIR
    assert level1["a.txt"].path == f"{base}/a.txt"
    level2 = {e.path for e in sbx.files.list(base, depth=2)}
    assert level2 == {f"{base}/a.txt", f"{base}/sub", f"{base}/sub/b.txt", f"{base}/sub/subsub"}
    level3 = {e.path for e in sbx.files.list(base, depth=3)}
    assert f"{base}/sub/subsub/c.txt" in level3

    info = sbx.files.get_info(f"{base}/a.txt")
    assert (info.name, info.size, info.type, info.path) == ("a.txt", 5, FileType.FILE, f"{base}/a.txt")
    assert info.permissions.startswith("-rw")
    assert abs((info.modified_time - datetime.now(UTC)).total_seconds()) < 300

    assert sbx.files.exists(f"{base}/a.txt") is True
    assert sbx.files.exists(f"{base}/missing.txt") is False

    moved = sbx.files.rename(f"{base}/a.txt", f"{base}/sub/renamed.txt")
    assert moved.path == f"{base}/sub/renamed.txt"
    assert moved.name == "renamed.txt"
    assert sbx.files.exists(f"{base}/a.txt") is False
    assert sbx.files.read(f"{base}/sub/renamed.txt") == "12345"

    sbx.files.remove(f"{base}/sub/renamed.txt")
    assert sbx.files.exists(f"{base}/sub/renamed.txt") is False
    sbx.files.remove(f"{base}/sub")  # a non-empty directory
    assert sbx.files.exists(f"{base}/sub") is False
    assert {e.name for e in sbx.files.list(base)} == set()

    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{base}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{base}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.list(f"{base}/missing-dir")


def test_files_watch_dir_polling(sbx: Sandbox) -> None:
    base = f"/home/user/e2e-watch-{uuid.uuid4().hex[:8]}"
    sbx.files.make_dir(base)
    handle = sbx.files.watch_dir(base)
    try:
        sbx.files.write(f"{base}/new.txt", "x")
        sbx.commands.run(f"echo more >> {base}/new.txt; rm {base}/new.txt")
        events: list = []

        def saw_all() -> bool:
            events.extend(handle.get_new_events())
            kinds = {(e.name, e.type) for e in events}
            return {("new.txt", FilesystemEventType.CREATE),
                    ("new.txt", FilesystemEventType.REMOVE)} <= kinds

        wait_until(saw_all, 15, interval=0.3, what="create and remove events")
        assert any(e.type == FilesystemEventType.WRITE for e in events)
        # events are handed out once
        time.sleep(0.5)
        assert [e for e in handle.get_new_events() if e.name == "new.txt"] == []
    finally:
        handle.stop()


def test_signed_download_and_upload_urls(sbx: Sandbox) -> None:
    path = f"/home/user/e2e-url-{uuid.uuid4().hex[:8]}.txt"
    sbx.files.write(path, "via signed url")
    with httpx.Client(timeout=30) as http:  # no sandbox headers, no access token
        resp = http.get(sbx.download_url(path))
        assert resp.status_code == 200, resp.text
        assert resp.content == b"via signed url"
        resp = http.post(sbx.upload_url(path + ".up"), files={"file": ("x.txt", b"uploaded")})
        assert resp.status_code == 200, resp.text
        # a URL signed for one path does not open another
        forged = sbx.download_url(path).replace("e2e-url-", "e2e-xxx-")
        assert http.get(forged).status_code in (401, 403, 404)
    assert sbx.files.read(path + ".up") == "uploaded"


# ------------------------------------------------------------------ connect


def test_connect_to_running_sandbox(sbx: Sandbox) -> None:
    path = f"/home/user/e2e-conn-{uuid.uuid4().hex[:8]}.txt"
    sbx.files.write(path, "shared")
    before = sbx.get_info().end_at
    other = Sandbox.connect(sbx.sandbox_id, timeout=900)
    assert other.sandbox_id == sbx.sandbox_id
    assert other.files.read(path) == "shared"
    assert other.commands.run("hostname").stdout.strip() == sbx.sandbox_id
    after = other.get_info().end_at
    assert after > before  # connect extended the time to live to ~now + 900 s
    assert after - datetime.now(UTC) > timedelta(seconds=800)


# ------------------------------------------------------------------ list


def test_list_filters_and_paging(run_id: str) -> None:
    meta = {"e2e-list": run_id}
    odd = "a&b=c d/é+%25?#"
    created: list[Sandbox] = []

    def create(i: int) -> Sandbox:
        extra = {"odd": odd} if i == 1 else {}
        s = Sandbox.create(metadata={**meta, "idx": str(i), **extra}, timeout=120)
        created.append(s)
        return s

    try:
        with ThreadPoolExecutor(3) as pool:
            sandboxes = list(pool.map(create, range(3)))
        ids = {s.sandbox_id for s in sandboxes}
        assert len(ids) == 3

        # all three through pages of 2
        paginator = Sandbox.list(query=SandboxQuery(metadata=meta), limit=2)
        assert paginator.has_next
        page1 = paginator.next_items()
        assert len(page1) == 2
        assert paginator.has_next and paginator.next_token
        page2 = paginator.next_items()
        assert len(page2) == 1
        assert not paginator.has_next
        assert {s.sandbox_id for s in page1 + page2} == ids
        for s in page1 + page2:
            assert s.metadata["e2e-list"] == run_id
            assert s.state == SandboxState.RUNNING

        # metadata filters: every pair must match, values with reserved characters work
        assert _ids(SandboxQuery(metadata={**meta, "idx": "2"})) == [sandboxes[2].sandbox_id]
        assert _ids(SandboxQuery(metadata={"odd": odd, **meta})) == [sandboxes[1].sandbox_id]
        assert _ids(SandboxQuery(metadata={**meta, "idx": "7"})) == []
        # state filters
        assert set(_ids(SandboxQuery(metadata=meta, state=[SandboxState.RUNNING]))) == ids
        assert set(_ids(SandboxQuery(metadata=meta,
                                     state=[SandboxState.RUNNING, SandboxState.PAUSED]))) == ids
        assert _ids(SandboxQuery(metadata=meta, state=[SandboxState.PAUSED])) == []
        # without filters the listing includes ours (and possibly the module sandbox)
        assert ids <= set(_ids(SandboxQuery()))
    finally:
        for s in created:
            s.kill()
    assert _ids(SandboxQuery(metadata=meta)) == []


# ------------------------------------------------------------------ lifecycle


def test_kill_then_second_kill_is_false(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-kill": run_id}, timeout=120)
    try:
        assert s.commands.run("echo alive").stdout == "alive\n"
        handle = s.commands.run("sleep 100", background=True, timeout=90)
    finally:
        assert s.kill() is True
    # a command stream open at kill time ends promptly with an error
    started = time.monotonic()
    with pytest.raises(Exception) as exc_info:  # any error, but not a hang
        handle.wait()
    assert time.monotonic() - started < 15, f"stream hung after kill: {exc_info.value!r}"
    assert s.kill() is False
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        s.get_info()
    assert _ids(SandboxQuery(metadata={"e2e-kill": run_id})) == []
    assert s.is_running() is False
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("echo should-not-run")


def test_set_timeout_and_expiry(run_id: str) -> None:
    meta = {"e2e-expiry": run_id}
    created: list[Sandbox] = []

    def create(ttl: int) -> Sandbox:
        s = Sandbox.create(metadata={**meta, "kind": str(ttl)}, timeout=ttl)
        created.append(s)
        return s

    try:
        with ThreadPoolExecutor(2) as pool:
            short, extended = pool.map(create, (2, 60))
        # set_timeout may extend...
        before = extended.get_info().end_at
        extended.set_timeout(240)
        later = extended.get_info().end_at
        assert later - before > timedelta(seconds=120)
        assert extended.is_running()
        # ...and shorten
        extended.set_timeout(2)
        shortened = extended.get_info().end_at
        assert shortened - datetime.now(UTC) < timedelta(seconds=5)

        def running() -> list[str]:
            return _ids(SandboxQuery(metadata=meta, state=[SandboxState.RUNNING]))

        wait_until(lambda: not running(), 15, interval=0.5,
                   what="both sandboxes to stop running after their TTL")
        for s in (short, extended):
            # our default on expiry is pause (E2B's is kill): the record stays, paused
            assert s.get_info().state == SandboxState.PAUSED
            assert s.is_running() is False
    finally:
        for s in created:
            s.kill()


@pytest.mark.slow
def test_thirty_sandboxes_at_once(run_id: str) -> None:
    count = 30
    meta = {"e2e-thirty": run_id}
    created: list[Sandbox] = []
    lock = threading.Lock()

    def create(i: int) -> Sandbox:
        s = Sandbox.create(metadata={**meta, "i": str(i)}, envs={"IDX": str(i)}, timeout=300)
        with lock:
            created.append(s)
        return s

    try:
        with ThreadPoolExecutor(10) as pool:
            sandboxes = list(pool.map(create, range(count)))
            assert len({s.sandbox_id for s in sandboxes}) == count
            live = set(_ids(SandboxQuery(metadata=meta, state=[SandboxState.RUNNING])))
            assert live == {s.sandbox_id for s in sandboxes}
            outputs = list(pool.map(lambda s: s.commands.run("echo $IDX; hostname").stdout,
                                    sandboxes))
        for i, (s, out) in enumerate(zip(sandboxes, outputs)):
            assert out.split() == [str(i), s.sandbox_id]
        with ThreadPoolExecutor(10) as pool:
            assert all(pool.map(lambda s: s.kill(), sandboxes))
        assert _ids(SandboxQuery(metadata=meta)) == []
    finally:
        for s in created:
            s.kill()
