"""The files API acts as the user it is asked to act as (issue 11, finding 8).

The attacker is a client holding the sandbox's envd token, or a signed URL for user `user`,
that tries to reach files only root may touch: reading /etc/shadow, writing through a
symlink the user planted, `..` out of the home in a signed upload, listing /root. Before
the fix envd did all of it as root. Every refusal is paired with a positive control (the
same operation as root, or on the user's own files) so that a probe broken some other way
cannot pass for a refusal.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import FileType, Sandbox, SandboxException


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=600)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def _as_root(sbx: Sandbox, command: str) -> str:
    return sbx.commands.run(command, user="root").stdout


def _denied(error: pytest.ExceptionInfo[SandboxException]) -> None:
    text = str(error.value)
    assert "403" in text or "PERMISSION_DENIED" in text, text
    assert "permission denied" in text.lower(), text


def test_user_cannot_read_etc_shadow(sbx: Sandbox) -> None:
    assert "root:" in sbx.files.read("/etc/shadow", user="root")  # control: it is readable
    with pytest.raises(SandboxException) as error:
        sbx.files.read("/etc/shadow", user="user")
    _denied(error)


def test_user_cannot_write_through_a_planted_symlink(sbx: Sandbox) -> None:
    tag = uuid.uuid4().hex[:8]
    shadow_before = _as_root(sbx, "sha256sum /etc/shadow")
    sbx.commands.run(f"ln -s /etc/shadow ~/shadow-{tag} && ln -s /root/x-{tag} ~/rootx-{tag}",
                     user="user")
    with pytest.raises(SandboxException) as error:
        sbx.files.write(f"/home/user/shadow-{tag}", "root::0:0:::::\n", user="user")
    _denied(error)
    with pytest.raises(SandboxException) as error:
        sbx.files.write(f"/home/user/rootx-{tag}", "planted", user="user")
    _denied(error)
    assert _as_root(sbx, "sha256sum /etc/shadow") == shadow_before
    assert _as_root(sbx, f"test -e /root/x-{tag} && echo present || echo absent").strip() == "absent"
    # control: the same write through a link into the user's own file goes through
    sbx.commands.run(f"touch ~/own-{tag} && ln -s ~/own-{tag} ~/ownlink-{tag}", user="user")
    sbx.files.write(f"/home/user/ownlink-{tag}", "mine", user="user")
    assert sbx.files.read(f"/home/user/own-{tag}", user="user") == "mine"


def test_signed_upload_cannot_climb_out_of_home(sbx: Sandbox) -> None:
    tag = uuid.uuid4().hex[:8]
    with httpx.Client(timeout=30) as http:
        escape = sbx.upload_url(f"/home/user/../../root/evil-{tag}.txt", user="user")
        resp = http.post(escape, files={"file": ("evil.txt", b"evil")})
        assert resp.status_code == 403, resp.text
        assert "permission denied" in resp.text.lower(), resp.text
        # control: the same kind of URL for a path in the home works
        home = sbx.upload_url(f"/home/user/up-{tag}.txt", user="user")
        resp = http.post(home, files={"file": ("up.txt", b"fine")})
        assert resp.status_code == 200, resp.text
    assert not sbx.files.exists(f"/root/evil-{tag}.txt", user="root")
    assert sbx.files.read(f"/home/user/up-{tag}.txt", user="user") == "fine"


def test_user_cannot_list_or_stat_into_root(sbx: Sandbox) -> None:
    tag = uuid.uuid4().hex[:8]
    sbx.files.write(f"/root/secret-{tag}", "s", user="root")
    assert f"secret-{tag}" in {e.name for e in sbx.files.list("/root", user="root")}  # control
    with pytest.raises(SandboxException) as error:
        sbx.files.list("/root", user="user")
    _denied(error)
    with pytest.raises(SandboxException) as error:
        sbx.files.get_info(f"/root/secret-{tag}", user="user")
    _denied(error)
    with pytest.raises(SandboxException) as error:
        sbx.files.make_dir(f"/root/made-{tag}", user="user")
    _denied(error)
    with pytest.raises(SandboxException) as error:
        sbx.files.remove(f"/root/secret-{tag}", user="user")
    _denied(error)
    with pytest.raises(SandboxException) as error:
        sbx.files.watch_dir("/root", user="user")
    _denied(error)
    assert sbx.files.read(f"/root/secret-{tag}", user="root") == "s"


def test_what_the_user_writes_is_the_users(sbx: Sandbox) -> None:
    tag = uuid.uuid4().hex[:8]
    info = sbx.files.write(f"/home/user/new-{tag}/deep/file.txt", "hello", user="user")
    assert info.type == FileType.FILE
    assert sbx.files.read(f"/home/user/new-{tag}/deep/file.txt", user="user") == "hello"
    owners = _as_root(sbx, f"stat -c '%U:%G' /home/user/new-{tag} /home/user/new-{tag}/deep "
                           f"/home/user/new-{tag}/deep/file.txt").split()
    assert owners == ["user:user"] * 3, owners
    entry = sbx.files.get_info(f"/home/user/new-{tag}/deep/file.txt", user="user")
    assert (entry.owner, entry.group) == ("user", "user")
    # root's writes stay root's
    sbx.files.write(f"/root/by-root-{tag}", "r", user="root")
    assert _as_root(sbx, f"stat -c '%U' /root/by-root-{tag}").strip() == "root"
