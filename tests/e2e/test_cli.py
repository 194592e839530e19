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


def test_start_with_cpu_memory_timeout(cli_env: dict[str, str], api: httpx.Client) -> None:
    proc = aenv(cli_env, "start", "--cpu", "1", "--memory", "256", "--timeout", "60", "--detach",
                "-o", "json")
    assert proc.returncode == 0, proc.stderr
    sid = json.loads(proc.stdout)["sandboxID"]
    try:
        info = api.get(f"/sandboxes/{sid}").json()
        assert (info["cpuCount"], info["memoryMB"]) == (1, 256)
        if info.get("runtime") == "container":  # and the kernel enforces them (cgroups v1)
            cgroup = Path("/sys/fs/cgroup")
            limit = (cgroup / "memory" / "aenv" / sid / "memory.limit_in_bytes").read_text()
            assert int(limit) == 256 << 20
            quota = (cgroup / "cpu" / "aenv" / sid / "cpu.cfs_quota_us").read_text()
            period = (cgroup / "cpu" / "aenv" / sid / "cpu.cfs_period_us").read_text()
            assert int(quota) == int(period)  # one CPU
        end = datetime.fromisoformat(info["endAt"])
        assert abs((end - datetime.now(UTC)) - timedelta(seconds=60)) < timedelta(seconds=15)
        # a different shape gives different limits (the values are not just the defaults)
        proc = aenv(cli_env, "start", "--memory", "384", "-d", "-o", "json")
        assert proc.returncode == 0, proc.stderr
        other = json.loads(proc.stdout)["sandboxID"]
        assert api.get(f"/sandboxes/{other}").json()["memoryMB"] == 384
        api.delete(f"/sandboxes/{other}")
    finally:
        api.delete(f"/sandboxes/{sid}")
    assert_clean_error(aenv(cli_env, "start", "--memory", "1", "-d"), "memoryMB")
    proc = aenv(cli_env, "start", "--cpu", "many", "-d")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def test_upload_download_round_trip(started: dict[str, str], cli_env: dict[str, str],
                                    tmp_path: Path) -> None:
    sid = started["sandboxID"]
    big = tmp_path / "big.bin"
    with big.open("wb") as f:
        for _ in range(20):
            f.write(os.urandom(1 << 20))
    proc = aenv(cli_env, "upload", sid, str(big), "/home/user/data/big.bin", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bytes"] == 20 << 20
    assert "upload big.bin" in proc.stderr and "100%" in proc.stderr  # the progress bar
    remote_sum = aenv(cli_env, "exec", sid, "--", "sha256sum", "/home/user/data/big.bin")
    assert remote_sum.stdout.split()[0] == _sha256(big), remote_sum.stderr

    back = tmp_path / "back.bin"
    proc = aenv(cli_env, "download", sid, "/home/user/data/big.bin", str(back))
    assert proc.returncode == 0, proc.stderr
    assert back.stat().st_size == 20 << 20 and _sha256(back) == _sha256(big)
    assert "100%" in proc.stderr
    # into an existing directory: the remote name is kept; no temporary files are left
    (tmp_path / "into").mkdir()
    proc = aenv(cli_env, "download", sid, "/home/user/data/big.bin", str(tmp_path / "into"))
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path / "into") == ["big.bin"]
    assert _sha256(tmp_path / "into" / "big.bin") == _sha256(big)

    # directories travel as tar archives, both ways
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha\n")
    (tree / "sub" / "b.txt").write_text("beta\n")
    proc = aenv(cli_env, "upload", sid, str(tree), "/home/user/tree")
    assert proc.returncode == 0, proc.stderr
    out = aenv(cli_env, "exec", sid, "--", "sh", "-c",
               "cat /home/user/tree/a.txt /home/user/tree/sub/b.txt; stat -c %U /home/user/tree/sub/b.txt;"
               " ls -a /tmp | grep -c aenv-upload")
    assert out.stdout.split() == ["alpha", "beta", "user", "0"], out.stderr
    proc = aenv(cli_env, "download", sid, "/home/user/tree", str(tmp_path / "tree-back"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tree-back" / "sub" / "b.txt").read_text() == "beta\n"
    assert (tmp_path / "tree-back" / "a.txt").read_text() == "alpha\n"

    # bad input: one line on stderr, exit 1, no traceback, nothing written
    assert_clean_error(aenv(cli_env, "upload", sid, str(tmp_path / "missing.bin"), "/tmp/x"),
                       "missing.bin", "no such file")
    assert_clean_error(aenv(cli_env, "download", sid, "/home/user/nope.bin",
                            str(tmp_path / "nope.bin")), "does not exist")
    assert not (tmp_path / "nope.bin").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert_clean_error(aenv(cli_env, "upload", sid, str(big), "/etc/passwd"), "permission")
    unknown = "zzzzzzzzzzzzzzzzzzzz"
    assert_clean_error(aenv(cli_env, "upload", unknown, str(big), "/tmp/x"), "not found")
    assert_clean_error(aenv(cli_env, "download", unknown, "/tmp/x", str(tmp_path / "x")),
                       "not found")
    proc = aenv(cli_env, "-o", "json", "download", unknown, "/tmp/x", str(tmp_path / "x"))
    assert proc.returncode == 1 and "not found" in json.loads(proc.stderr)["error"]["message"]


def _drive_pty(argv: list[str], env: dict[str, str], send: bytes, timeout: float = 60
               ) -> tuple[int, bytes]:
    """Run `argv` on a fresh pseudo-terminal, type `send` once the remote shell has
    printed something, and collect everything until the command exits."""
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the CLI, the pty is its terminal
        os.execve(argv[0], argv, env)
    output, sent, deadline = b"", False, time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            # after the "connected" line, the shell's prompt: now input reaches bash
            if not sent and b"connected to sandbox" in output and output.rstrip().endswith(
                    (b"$", b"#")):
                os.write(fd, send)
                sent = True
        else:
            os.kill(pid, 9)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), output


def test_connect_attaches_a_shell(started: dict[str, str], cli_env: dict[str, str],
                                  api: httpx.Client) -> None:
    sid = started["sandboxID"]
    code, output = _drive_pty([AENV, "connect", sid], {**cli_env, "TERM": "dumb"},
                              b"echo marker-$((6*7)) $(id -un); exit 7\n")
    text = output.decode(errors="replace")
    assert "marker-42 user" in text, text  # the arithmetic ran: not just the echoed input
    assert code == 7, text
    # leaving the shell leaves the sandbox running
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    assert_clean_error(aenv(cli_env, "connect", "zzzzzzzzzzzzzzzzzzzz"), "not found")


def test_template_watch(cli_env: dict[str, str], api: httpx.Client, run_id: str) -> None:
    name = f"cli-watch-{run_id}"
    requested = api.post("/v3/templates", json={"name": name})
    assert requested.status_code == 202, requested.text
    template_id, build_id = requested.json()["templateID"], requested.json()["buildID"]
    try:
        started = api.post(f"/v2/templates/{template_id}/builds/{build_id}", json={
            "fromTemplate": "base",
            "steps": [{"type": "RUN", "args": ["sleep 1; echo watch-marker-$((6*7))"]}]})
        assert started.status_code == 202, started.text
        proc = aenv(cli_env, "template", "watch", name, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "watch-marker-42" in proc.stderr, proc.stderr
        assert proc.stdout.strip() == f"build {build_id}: ready"
        assert api.get(f"/templates/{template_id}/builds/{build_id}/status").json()[
            "status"] == "ready"
        # a finished build: its whole log again, and the result as JSON
        proc = aenv(cli_env, "template", "watch", template_id, build_id, "-o", "json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == {"templateID": template_id, "buildID": build_id,
                                           "status": "ready"}
        assert "watch-marker-42" in proc.stderr

        # a failing build: exit 1 and the reason
        rebuild = api.post("/v3/templates", json={"name": name}).json()
        assert rebuild["templateID"] == template_id
        api.post(f"/v2/templates/{template_id}/builds/{rebuild['buildID']}", json={
            "fromTemplate": "base", "steps": [{"type": "RUN", "args": ["exit 3"]}]})
        proc = aenv(cli_env, "template", "watch", name, timeout=300)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert proc.stdout.startswith(f"build {rebuild['buildID']}: error"), proc.stdout
        assert "Traceback" not in proc.stderr
    finally:
        api.delete(f"/templates/{template_id}")
    assert_clean_error(aenv(cli_env, "template", "watch", f"no-such-{run_id}"), "not found")
    assert_clean_error(aenv(cli_env, "template", "watch"), "template watch needs")
