"""Attacks by a local, unprivileged host user (uid 65534, no groups) on the server's files.

The database and its WAL hold every sandbox's envd access token (with one, the proxy lets
anyone read a sandbox's /etc/shadow), `secrets/api_key` opens the control plane, and a paused
sandbox's checkpoint image is its memory, token included. Before the fix all of them were
0644 under a 0755 home. Each read is first done as root (positive control: the file is there
and holds the secret), then as the host user, who must be refused.
"""

from __future__ import annotations

import json
import sqlite3
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv.devserver import ServerProcess
from aenv.storage.layout import Layout

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_host_user(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*NOBODY, *argv], capture_output=True, timeout=30, check=False)


def envd_token(home: Path, sandbox_id: str) -> str:
    db = sqlite3.connect(f"file:{home / 'aenv.sqlite3'}?mode=ro", uri=True)
    try:
        (body,) = db.execute("SELECT body FROM sandboxes WHERE sandbox_id = ?",
                             (sandbox_id,)).fetchone()
    finally:
        db.close()
    token = json.loads(body)["envd_access_token"]
    assert isinstance(token, str) and len(token) >= 16
    return token


def files_holding(paths: list[Path], secret: bytes) -> list[Path]:
    return [p for p in paths if p.is_file() and secret in p.read_bytes()]


@pytest.fixture
def paused_sandbox(run_id: str) -> Iterator[Sandbox]:
    s = Sandbox.create(metadata={"sec-perm": run_id}, timeout=120)
    try:
        yield s
    finally:
        s.kill()


def test_host_user_cannot_read_tokens_api_key_or_sandbox_memory(
        server: ServerProcess, paused_sandbox: Sandbox) -> None:
    home = server.home
    s = paused_sandbox
    token = envd_token(home, s.sandbox_id)
    # A process that keeps the token in its memory, so the checkpoint image must hold it.
    s.commands.run(f"exec -a holder python3 -c 'import time; t={token!r}; time.sleep(600)'",
                   background=True, timeout=0).disconnect()
    assert s.pause() is True
    images = sorted((home / "sandboxes" / s.sandbox_id / "checkpoints").glob("pause-*"))
    assert images, "no checkpoint image of the paused sandbox"

    # Positive controls, as root: each target exists and holds its secret.
    db_files = [home / "aenv.sqlite3", home / "aenv.sqlite3-wal"]
    assert files_holding(db_files, token.encode()), "the token is in neither the db nor its wal"
    # The test server takes its key from the environment: the node's own key file is then
    # made here, by the server's code for it, as on a node without AENV_API_KEY.
    node_key = Layout(home).api_key().encode()
    api_key = home / "secrets" / "api_key"
    assert node_key in api_key.read_bytes()
    memory = files_holding(sorted(images[-1].glob("*.img")), token.encode())
    assert memory, "the token is not in the checkpoint image"

    # The attack: read each of them as an ordinary host user.
    for target in [*db_files, api_key, *memory]:
        got = as_host_user("cat", str(target))
        assert got.returncode != 0 and b"Permission denied" in got.stderr, \
            f"{target} is readable by a host user: {got.returncode} {got.stderr!r}"
        assert token.encode() not in got.stdout and node_key not in got.stdout
    listing = as_host_user("ls", str(home))
    assert listing.returncode != 0 and b"Permission denied" in listing.stderr

    # And on their own, whatever the home's mode: files 0600, directories 0700.
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    for path in (*db_files, api_key):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is group/other-accessible"
    assert stat.S_IMODE(images[-1].parent.stat().st_mode) == 0o700


def test_host_user_cannot_run_a_setuid_file_a_sandbox_left(
        server: ServerProcess, run_id: str) -> None:
    """Root in a sandbox makes a setuid-root shell in its writable layer; a host user tries
    to run it from the host side (finding 1's path into the host)."""
    s = Sandbox.create(metadata={"sec-perm": run_id}, timeout=120)
    try:
        made = s.commands.run("cp /bin/bash /tmp/rb && chmod 4755 /tmp/rb && stat -c %a /tmp/rb",
                              user="root")
        assert made.stdout.strip() == "4755"
        upper = server.home / "sandboxes" / s.sandbox_id / "upper" / "tmp" / "rb"
        assert upper.is_file()  # positive control: it is on the host
        # Through a shell of the host user's own: setpriv opens the program it is given with
        # root's access before it drops it, which is not what an attacker has.
        got = as_host_user("/bin/sh", "-c", f"{upper} -p -c 'id -u'")
        assert got.stdout.strip() != b"0", "a host user became root through a sandbox's file"
        assert got.returncode != 0 and b"Permission denied" in got.stderr
    finally:
        s.kill()


@pytest.mark.parametrize("where", ["home", "parent"])
def test_server_refuses_a_home_others_can_write(where: str) -> None:
    with tempfile.TemporaryDirectory(prefix="aenv-sec-home-") as tmp:
        parent = Path(tmp)
        home = parent / "home"
        home.mkdir()
        (home if where == "home" else parent).chmod(0o777)  # no sticky bit: anyone can swap it
        srv = ServerProcess(home=home, api_key="perm-key", log_path=Path(tmp) / "server.log")
        with pytest.raises(RuntimeError, match="exited with 2"):
            srv.start(ready_timeout=60)
        log = (Path(tmp) / "server.log").read_text()
        assert "writable by other users" in log, log
        assert "Traceback" not in log, log
        assert not (home / "aenv.sqlite3").exists()  # refused before anything was made
