"""The `aenv` command against the test server, run as a user would run it (a subprocess)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from e2e_helpers import live_sandbox_ids

from aenv.devserver import ServerProcess, free_port

AENV = str(Path(sys.executable).parent / "aenv")


@pytest.fixture
def cli_env(server: ServerProcess, tmp_path: Path) -> dict[str, str]:
    """Environment for the CLI: the test server, and a private config dir (no saved
    credentials from elsewhere)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AENV_", "E2B_"))}
    env.update({"AENV_URL": server.url, "AENV_API_KEY": server.api_key,
                "XDG_CONFIG_HOME": str(tmp_path / "config"), "NO_PROXY": "127.0.0.1,localhost"})
    return env


def aenv(env: dict[str, str], *args: str, stdin: str | None = None,
         timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AENV, *args], check=False, env=env, capture_output=True, text=True, input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None, timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    assert proc.stderr.strip(), "an error must say something on stderr"
    for needle in needles:
        assert needle.lower() in proc.stderr.lower(), proc.stderr


@pytest.fixture
def started(cli_env: dict[str, str], api: httpx.Client) -> Iterator[dict[str, str]]:
    """A sandbox created with `aenv start --detach -o json`, removed afterwards."""
    proc = aenv(cli_env, "start", "--detach", "-o", "json", "--env", "CLI_VAR=from-cli")
    assert proc.returncode == 0, proc.stderr
    sbx = json.loads(proc.stdout)
    try:
        yield sbx
    finally:
        api.delete(f"/sandboxes/{sbx['sandboxID']}")


def test_start_detach_json(started: dict[str, str], api: httpx.Client) -> None:
    sid = started["sandboxID"]
    assert isinstance(sid, str) and len(sid) == 20 and sid.isalnum()
    assert started["templateID"] == "base"
    detail = api.get(f"/sandboxes/{sid}")
    assert detail.status_code == 200 and detail.json()["state"] == "running"


def test_start_detach_table(cli_env: dict[str, str], api: httpx.Client) -> None:
    before = live_sandbox_ids(api)
    proc = aenv(cli_env, "start", "-d", "--timeout", "60")
    new = live_sandbox_ids(api) - before
    try:
        assert proc.returncode == 0, proc.stderr
        assert len(new) == 1
        header, row = proc.stdout.strip().splitlines()
        assert "SANDBOXID" in header
        assert row.split()[0] == next(iter(new))
    finally:
        for sid in new:
            api.delete(f"/sandboxes/{sid}")


def test_exec_exit_code_and_output(started: dict[str, str], cli_env: dict[str, str]) -> None:
    sid = started["sandboxID"]
    proc = aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo hi; echo oops >&2; exit 3")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert proc.stdout == "hi\n"
    assert "oops" in proc.stderr
    proc = aenv(cli_env, "exec", sid, "--", "sh", "-c", 'echo "$CLI_VAR"; id -un; pwd')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["from-cli", "user", "/home/user"]
    proc = aenv(cli_env, "exec", "--user", "root", "--cwd", "/tmp", "-e", "X=1", sid, "--",
                "sh", "-c", 'id -u; pwd; echo "$X"')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "/tmp", "1"]
    # arguments keep their boundaries (no shell re-splitting)
    proc = aenv(cli_env, "exec", sid, "--", "printf", "[%s]", "a b", "c;d", "$HOME")
    assert proc.stdout == "[a b][c;d][$HOME]"


def test_ls_table_and_json(started: dict[str, str], cli_env: dict[str, str]) -> None:
    sid = started["sandboxID"]
    proc = aenv(cli_env, "ls")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["SANDBOXID", "TEMPLATEID", "STATE"]
    row = next(ln for ln in lines[1:] if ln.startswith(sid))
    assert row.split()[1:3] == ["base", "running"]

    for args in (("ls", "-o", "json"), ("-o", "json", "ls")):
        proc = aenv(cli_env, *args)
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(proc.stdout)
        assert isinstance(rows, list)
        mine = [r for r in rows if r["sandboxID"] == sid]
        assert len(mine) == 1 and mine[0]["state"] == "running"

    proc = aenv(cli_env, "ls", "--state", "paused", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert sid not in {r["sandboxID"] for r in json.loads(proc.stdout)}


def test_timeout_and_info(started: dict[str, str], cli_env: dict[str, str],
                          api: httpx.Client) -> None:
    sid = started["sandboxID"]
    proc = aenv(cli_env, "timeout", sid, "120")
    assert proc.returncode == 0, proc.stderr
    assert sid in proc.stdout
    end = datetime.fromisoformat(api.get(f"/sandboxes/{sid}").json()["endAt"])
    assert abs((end - datetime.now(UTC)) - timedelta(seconds=120)) < timedelta(seconds=15)

    proc = aenv(cli_env, "info", sid)
    assert proc.returncode == 0, proc.stderr
    assert sid in proc.stdout and "running" in proc.stdout
    proc = aenv(cli_env, "info", sid, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["sandboxID"] == sid and info["state"] == "running"
    assert "envdAccessToken" not in info  # secrets are not printed

    assert_clean_error(aenv(cli_env, "timeout", sid, "-5"))
    assert_clean_error(aenv(cli_env, "info", "zzzzzzzzzzzzzzzzzzzz"), "not found")


def test_rm(cli_env: dict[str, str], api: httpx.Client) -> None:
    proc = aenv(cli_env, "-o", "json", "start", "-d")
    assert proc.returncode == 0, proc.stderr
    sid = json.loads(proc.stdout)["sandboxID"]
    try:
        proc = aenv(cli_env, "rm", sid)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == sid
        assert api.get(f"/sandboxes/{sid}").status_code == 404
        proc = aenv(cli_env, "rm", sid)
        assert_clean_error(proc, sid, "not found")
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_unknown_ids_give_clean_errors(cli_env: dict[str, str]) -> None:
    unknown = "zzzzzzzzzzzzzzzzzzzz"
    assert_clean_error(aenv(cli_env, "rm", unknown), unknown, "not found")
    assert_clean_error(aenv(cli_env, "exec", unknown, "--", "true"), "not found")
    proc = aenv(cli_env, "-o", "json", "rm", unknown)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


def test_auth_saves_credentials(cli_env: dict[str, str], server: ServerProcess,
                                tmp_path: Path) -> None:
    env = dict(cli_env)
    del env["AENV_API_KEY"]
    cred = tmp_path / "config" / "aenv" / "credentials.json"

    # without a key, commands fail cleanly
    assert_clean_error(aenv(env, "ls"), "api key")
    # a wrong key is refused and not saved
    assert_clean_error(aenv(env, "auth", "wrong-key"), "invalid")
    assert not cred.exists()

    proc = aenv(env, "auth", server.api_key)
    assert proc.returncode == 0, proc.stderr
    assert cred.exists()
    assert stat.S_IMODE(cred.stat().st_mode) == 0o600
    saved = json.loads(cred.read_text())
    assert saved == {"url": server.url, "api_key": server.api_key}

    # later commands need neither AENV_API_KEY nor AENV_URL
    del env["AENV_URL"]
    proc = aenv(env, "ls", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout), list)

    # the key can also come from stdin
    cred.unlink()
    proc = aenv({**env, "AENV_URL": server.url}, "auth", stdin=server.api_key + "\n")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(cred.read_text())["api_key"] == server.api_key


def test_unreachable_server(cli_env: dict[str, str]) -> None:
    env = {**cli_env, "AENV_URL": f"http://127.0.0.1:{free_port()}"}
    for args in (("ls",), ("start", "-d"), ("info", "x"), ("rm", "x"), ("exec", "x", "--", "true")):
        proc = aenv(env, *args, timeout=30)
        assert proc.returncode == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "cannot reach" in proc.stderr, proc.stderr
    proc = aenv(env, "ls", "-o", "json")
    assert proc.returncode == 1
    err = json.loads(proc.stderr)
    assert "cannot reach" in err["error"]["message"]


def test_usage_errors_exit_2(cli_env: dict[str, str]) -> None:
    proc = aenv(cli_env, "nosuchverb")
    assert proc.returncode == 2 and "usage" in proc.stderr.lower()
    proc = aenv(cli_env, "timeout", "abc", "notanumber")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_pause_resume_fork_snapshot(started: dict[str, str], cli_env: dict[str, str],
                                    api: httpx.Client) -> None:
    sid = started["sandboxID"]
    proc = aenv(cli_env, "exec", sid, "--", "sh", "-c", "echo forked-state > /tmp/state")
    assert proc.returncode == 0, proc.stderr
    proc = aenv(cli_env, "snapshot", "create", sid, "--name", f"cli-{sid}", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["names"] == [f"cli-{sid}"] and snap["sandboxID"] == sid
    proc = aenv(cli_env, "snapshot", "ls", sid)
    assert proc.returncode == 0 and snap["snapshotID"] in proc.stdout, proc.stdout
    proc = aenv(cli_env, "fork", sid, "-n", "2", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    kids = [r["sandbox"]["sandboxID"] for r in json.loads(proc.stdout)]
    try:
        assert len(set(kids)) == 2
        for kid in kids:
            out = aenv(cli_env, "exec", kid, "--", "cat", "/tmp/state")
            assert out.returncode == 0 and out.stdout == "forked-state\n", out.stderr
        assert aenv(cli_env, "pause", sid).returncode == 0
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        assert_clean_error(aenv(cli_env, "pause", sid), "already paused")
        proc = aenv(cli_env, "resume", sid, "-o", "json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["state"] == "running", proc.stderr
        out = aenv(cli_env, "exec", sid, "--", "cat", "/tmp/state")
        assert out.stdout == "forked-state\n", out.stderr
        assert aenv(cli_env, "snapshot", "rm", snap["snapshotID"]).returncode == 0
        assert_clean_error(aenv(cli_env, "snapshot", "rm", snap["snapshotID"]), "not found")
    finally:
        for kid in kids:
            api.delete(f"/sandboxes/{kid}")
