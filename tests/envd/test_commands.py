"""Commands through the official SDK: run, exit codes, env, cwd, users, timeouts,
background processes, stdin, connect, kill, list."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    Sandbox,
    TimeoutException,
)


def wait_gone(sbx: Sandbox, pid: int, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid not in [p.pid for p in sbx.commands.list()]:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still listed")


def test_run_captures_stdout_and_stderr(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo out; echo err >&2; printf 'no newline'")
    assert result.exit_code == 0
    assert result.stdout == "out\nno newline"
    assert result.stderr == "err\n"
    assert result.error is None


def test_run_streams_output_callbacks(sbx: Sandbox) -> None:
    seen: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.05; done", on_stdout=seen.append)
    assert "".join(seen) == "line1\nline2\nline3\n"
    assert len(seen) >= 2  # streamed, not delivered in one piece at the end


def test_nonzero_exit_raises(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; echo bad >&2; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "partial\n"
    assert info.value.stderr == "bad\n"
    assert info.value.error == "exit status 3"


def test_large_output_is_complete(sbx: Sandbox) -> None:
    result = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' x")
    assert len(result.stdout) == 3_000_000


def test_env_layers(sbx: Sandbox) -> None:
    result = sbx.commands.run(
        'echo "$AENV_SANDBOX_VAR|$SHARED|$MINE|$HOME|$USER|$LOGNAME|$SHELL"',
        envs={"MINE": "request", "SHARED": "from-request"},
    )
    assert result.stdout.strip() == "sandbox|from-request|request|/home/aenvtest|aenvtest|aenvtest|/bin/bash"


def test_default_cwd_is_home_and_cwd_is_honoured(sbx: Sandbox, work: Path) -> None:
    assert sbx.commands.run("pwd").stdout.strip() == "/home/aenvtest"
    assert sbx.commands.run("pwd", cwd=str(work)).stdout.strip() == str(work)
    # relative and ~ paths resolve against the user's home
    assert sbx.commands.run("pwd", cwd="~").stdout.strip() == "/home/aenvtest"
    assert sbx.commands.run("pwd", cwd="..").stdout.strip() == "/home"


def test_missing_cwd_is_invalid_argument(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException, match="cwd '/nonexistent/dir' does not exist"):
        sbx.commands.run("true", cwd="/nonexistent/dir")


def test_runs_as_default_user_and_as_root(sbx: Sandbox, work: Path) -> None:
    assert sbx.commands.run("id -un").stdout.strip() == "aenvtest"
    root = sbx.commands.run("id -u; echo $HOME", user="root").stdout.split()
    assert root == ["0", "/root"]
    sbx.commands.run(f"touch {work}/by-user")
    assert Path(work, "by-user").stat().st_uid != 0


def test_supplementary_groups(sbx: Sandbox) -> None:
    groups = sbx.commands.run("id -Gn").stdout.split()
    assert groups[0] == "aenvtest" and "aenvtestgrp" in groups


def test_unknown_user_is_rejected(sbx: Sandbox) -> None:
    with pytest.raises(AuthenticationException, match="invalid username"):
        sbx.commands.run("true", user="no-such-user-xyz")


def test_timeout_kills_the_process(sbx: Sandbox, work: Path) -> None:
    marker = work / "survived"
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run(f"sleep 3; touch {marker}", timeout=0.5)
    assert time.monotonic() - started < 2.5
    time.sleep(3)
    assert not marker.exists()
    assert [p for p in sbx.commands.list() if "sleep 3" in " ".join(p.args)] == []


def test_background_stdin_connect_and_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, "hello\n")
    watcher = sbx.commands.connect(handle.pid)
    sbx.commands.send_stdin(handle.pid, b"again\n")
    time.sleep(0.3)
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as info:
        handle.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"
    assert "hello\nagain\n" in info.value.stdout
    with pytest.raises(CommandExitException) as watched:
        watcher.wait()
    assert "again\n" in watched.value.stdout  # a connect sees output from then on
    assert sbx.commands.kill(handle.pid) is False


def test_disconnect_keeps_process_running_and_connect_resumes(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 0.7; echo finished", background=True)
    handle.disconnect()
    time.sleep(0.1)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    result = sbx.commands.connect(handle.pid).wait()
    assert result.stdout == "finished\n"


def test_connect_after_exit_replays_the_end(sbx: Sandbox) -> None:
    handle = sbx.commands.run("exit 7", background=True)
    handle.disconnect()
    wait_gone(sbx, handle.pid)
    with pytest.raises(CommandExitException) as info:
        sbx.commands.connect(handle.pid).wait()
    assert info.value.exit_code == 7


def test_stream_input_and_close_stdin(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(handle.pid, ["chunk1\n", b"chunk2\n"])
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.exit_code == 0
    assert result.stdout == "chunk1\nchunk2\n"


def test_stdin_disabled_reads_eof(sbx: Sandbox) -> None:
    assert sbx.commands.run("cat; echo done").stdout == "done\n"


def test_list_reports_config_and_kill_unknown(sbx: Sandbox, work: Path) -> None:
    handle = sbx.commands.run("sleep 5", background=True, envs={"A": "1"}, cwd=str(work))
    try:
        info = next(p for p in sbx.commands.list() if p.pid == handle.pid)
        assert info.cmd == "/bin/bash"
        assert info.args == ["-l", "-c", "sleep 5"]
        assert info.envs == {"A": "1"}
        assert info.cwd == str(work)
    finally:
        handle.kill()
    assert sbx.commands.kill(999_999) is False


def test_kill_reaches_the_whole_command(sbx: Sandbox, work: Path) -> None:
    # bash forks for a compound command; the kill must not leave `sleep` behind.
    handle = sbx.commands.run(f"sleep 30 & echo $! > {work}/child; wait", background=True)
    deadline = time.monotonic() + 5
    while not (work / "child").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int((work / "child").read_text())
    handle.kill()
    with pytest.raises(CommandExitException):
        handle.wait()
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_background_descendant_does_not_hold_the_command(sbx: Sandbox) -> None:
    started = time.monotonic()
    result = sbx.commands.run("sleep 2 & echo started")
    assert result.stdout == "started\n"
    assert time.monotonic() - started < 1.5


async def test_async_commands(asbx: AsyncSandbox) -> None:
    result = await asbx.commands.run("echo async")
    assert result.stdout == "async\n"
    chunks: list[str] = []
    handle = await asbx.commands.run("cat", background=True, stdin=True, on_stdout=chunks.append)
    await asbx.commands.send_stdin(handle.pid, "x\n")
    await asbx.commands.close_stdin(handle.pid)
    done = await handle.wait()
    assert done.stdout == "x\n"
    assert "".join(chunks) == "x\n"
    with pytest.raises(CommandExitException):
        await asbx.commands.run("exit 2")
