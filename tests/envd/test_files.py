"""File transfer (`/files`) through the official SDK and signed URLs through httpx."""

from __future__ import annotations

import grp
import gzip
import io
import os
import pwd
import time
from pathlib import Path

import httpx
import pytest
from e2b import (
    AuthenticationException,
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry
from envd_helpers import TEST_GROUP, Envd, make_sandbox


def test_write_and_read_text_and_bytes(sbx: Sandbox, work: Path) -> None:
    info = sbx.files.write(f"{work}/hello.txt", "hello wörld")
    assert (info.path, info.name, info.type) == (f"{work}/hello.txt", "hello.txt", FileType.FILE)
    assert sbx.files.read(f"{work}/hello.txt") == "hello wörld"
    blob = bytes(range(256)) * 64
    sbx.files.write(f"{work}/blob.bin", blob)
    assert bytes(sbx.files.read(f"{work}/blob.bin", format="bytes")) == blob
    assert Path(work, "blob.bin").read_bytes() == blob


def test_write_creates_parents_owned_by_the_user(sbx: Sandbox, work: Path, test_user: pwd.struct_passwd) -> None:
    sbx.files.write(f"{work}/a/b/c.txt", "deep")
    for path in (work / "a", work / "a/b", work / "a/b/c.txt"):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (test_user.pw_uid, test_user.pw_gid), path
    sbx.files.write(f"{work}/root.txt", "r", user="root")
    assert Path(work, "root.txt").stat().st_uid == 0


def test_relative_paths_and_traversal_resolve_like_a_filesystem(sbx: Sandbox, work: Path) -> None:
    sbx.files.write("relative.txt", "in home")
    assert Path("/home/aenvtest/relative.txt").read_text() == "in home"
    assert sbx.files.read("~/relative.txt") == "in home"
    # `..` is just a path: the whole filesystem is the sandbox's
    traversal = "../.." + str(work) + "/escaped.txt"
    info = sbx.files.write(traversal, "x")
    assert info.path == f"{work}/escaped.txt"
    assert sbx.files.read(f"{work}/../{work.name}/escaped.txt") == "x"
    os.unlink("/home/aenvtest/relative.txt")


def test_overwrite_replaces_content(sbx: Sandbox, work: Path) -> None:
    sbx.files.write(f"{work}/f.txt", "a much longer first version")
    sbx.files.write(f"{work}/f.txt", "short")
    assert sbx.files.read(f"{work}/f.txt") == "short"


def test_streaming_upload_and_download(sbx: Sandbox, work: Path) -> None:
    size = 6 * 1024 * 1024
    chunk = os.urandom(64 * 1024)

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(size // len(chunk)):
            yield chunk

    sbx.files.write(f"{work}/big.bin", chunks())  # iterable: octet-stream, chunked
    assert Path(work, "big.bin").stat().st_size == size
    sbx.files.write(f"{work}/filelike.bin", io.BytesIO(chunk * 3))  # file-like: octet-stream
    assert Path(work, "filelike.bin").read_bytes() == chunk * 3
    total = 0
    with sbx.files.read(f"{work}/big.bin", format="stream") as stream:
        for piece in stream:
            total += len(piece)
    assert total == size


def test_gzip_upload_and_download(sbx: Sandbox, work: Path) -> None:
    text = "compress me " * 5000
    sbx.files.write(f"{work}/gz.txt", text, gzip=True)
    assert Path(work, "gz.txt").read_text() == text
    assert sbx.files.read(f"{work}/gz.txt", gzip=True) == text


def test_download_encoding_on_the_wire(envd: Envd, sbx: Sandbox, work: Path) -> None:
    Path(work, "w.txt").write_text("wire " * 1000)
    params = {"path": f"{work}/w.txt"}
    plain = httpx.get(envd.url + "/files", params=params, headers={**envd.headers(), "Accept-Encoding": "identity"})
    assert plain.status_code == 200 and "content-encoding" not in plain.headers
    assert plain.headers["content-length"] == str(5000)
    zipped = httpx.get(envd.url + "/files", params=params, headers={**envd.headers(), "Accept-Encoding": "gzip"})
    assert zipped.headers["content-encoding"] == "gzip"
    assert zipped.text == "wire " * 1000
    # httpx's default offer: identity is acceptable and much cheaper than deflating
    default = httpx.get(envd.url + "/files", params=params, headers={**envd.headers(), "Accept-Encoding": "gzip, deflate"})
    assert "content-encoding" not in default.headers and default.text == "wire " * 1000
    refused = httpx.get(envd.url + "/files", params=params, headers={**envd.headers(), "Accept-Encoding": "br;q=1, identity;q=0"})
    assert refused.status_code == 406
    ranged = httpx.get(envd.url + "/files", params=params, headers={**envd.headers(), "Range": "bytes=5-9"})
    assert ranged.status_code == 206 and ranged.content == b"wire "


def test_write_files_many_in_one_request(sbx: Sandbox, work: Path) -> None:
    entries: list[WriteEntry] = [
        {"path": f"{work}/m/one.txt", "data": "1"},
        {"path": f"{work}/m/two.txt", "data": b"2"},
        {"path": f"{work}/m/three.txt", "data": "3" * 100_000},
    ]
    infos = sbx.files.write_files(entries)
    assert [i.name for i in infos] == ["one.txt", "two.txt", "three.txt"]
    assert Path(work, "m/three.txt").read_text() == "3" * 100_000
    assert Path(work, "m/two.txt").read_text() == "2"


def test_metadata_is_stored_and_returned(sbx: Sandbox, work: Path) -> None:
    info = sbx.files.write(f"{work}/meta.txt", "m", metadata={"Owner": "me", "purpose": "test run"})
    assert info.metadata == {"owner": "me", "purpose": "test run"}
    assert sbx.files.get_info(f"{work}/meta.txt").metadata == {"owner": "me", "purpose": "test run"}
    listed = {e.name: e for e in sbx.files.list(str(work))}
    assert listed["meta.txt"].metadata == {"owner": "me", "purpose": "test run"}
    # an overwrite replaces the whole set
    info = sbx.files.write(f"{work}/meta.txt", "m2", metadata={"owner": "you"})
    assert sbx.files.get_info(f"{work}/meta.txt").metadata == {"owner": "you"}
    sbx.files.write(f"{work}/meta.txt", "m3")
    assert sbx.files.get_info(f"{work}/meta.txt").metadata is None


def test_read_errors(sbx: Sandbox, work: Path) -> None:
    with pytest.raises(FileNotFoundException, match="does not exist"):
        sbx.files.read(f"{work}/missing.txt")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sbx.files.read(str(work))
    with pytest.raises(AuthenticationException):
        sbx.files.read(f"{work}/missing.txt", user="no-such-user-xyz")


def test_signed_urls(envd: Envd, sbx: Sandbox, work: Path) -> None:
    Path(work, "signed.txt").write_text("secret")
    url = sbx.download_url(f"{work}/signed.txt")
    assert "signature=v1_" in url
    assert httpx.get(url).text == "secret"
    assert httpx.get(url.replace("signature=v1_", "signature=v1_x")).status_code == 401
    unsigned = url.split("&signature=")[0]
    assert httpx.get(unsigned).status_code == 401

    expiring = sbx.download_url(f"{work}/signed.txt", use_signature_expiration=60)
    assert httpx.get(expiring).text == "secret"
    expired = sbx.download_url(f"{work}/signed.txt", use_signature_expiration=-10)
    response = httpx.get(expired)
    assert response.status_code == 401 and "expired" in response.json()["message"]

    upload = sbx.upload_url(f"{work}/uploaded.txt", user="aenvtest")
    response = httpx.post(upload, files={"file": ("ignored-name", b"via signed url")})
    assert response.status_code == 200
    assert response.json()[0]["path"] == f"{work}/uploaded.txt"
    assert Path(work, "uploaded.txt").read_bytes() == b"via signed url"
    # a read signature does not authorise a write
    wrong_op = sbx.download_url(f"{work}/uploaded.txt").replace("/files?", "/files?x=1&")
    assert httpx.post(wrong_op, files={"file": ("f", b"nope")}).status_code == 401


def test_wrong_or_missing_token_is_rejected(envd: Envd, work: Path) -> None:
    bad = make_sandbox(envd, token="wrong-token")
    with pytest.raises(AuthenticationException):
        bad.files.read(f"{work}/x")
    with pytest.raises(AuthenticationException):
        bad.files.write(f"{work}/x", "x")
    assert httpx.get(envd.url + "/files", params={"path": "/etc/hostname"}).status_code == 401
    assert not Path(work, "x").exists()


def test_upload_into_a_directory_path_fails(sbx: Sandbox, work: Path) -> None:
    (work / "adir").mkdir()
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sbx.files.write(f"{work}/adir", "x")


def test_upload_of_odd_names(sbx: Sandbox, work: Path) -> None:
    name = f"{work}/with space & ünïcode \"q\".txt"
    sbx.files.write(name, "odd")
    assert Path(name).read_text() == "odd"
    assert sbx.files.read(name) == "odd"


def test_raw_gzip_octet_stream(envd: Envd, work: Path) -> None:
    body = gzip.compress(b"raw gz body")
    response = httpx.post(
        envd.url + "/files",
        params={"path": f"{work}/raw.txt"},
        content=body,
        headers={**envd.headers(), "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert response.status_code == 200, response.text
    assert Path(work, "raw.txt").read_bytes() == b"raw gz body"
    broken = httpx.post(
        envd.url + "/files",
        params={"path": f"{work}/broken.txt"},
        content=b"not gzip at all",
        headers={**envd.headers(), "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert broken.status_code == 400 and broken.json()["code"] == 400


def test_download_of_proc_file_streams(sbx: Sandbox) -> None:
    # /proc files report size 0; their content must still arrive
    assert "MemTotal" in sbx.files.read("/proc/meminfo")


def test_many_small_roundtrips_are_fast(sbx: Sandbox, work: Path) -> None:
    started = time.monotonic()
    for i in range(30):
        sbx.files.write(f"{work}/n{i}.txt", str(i))
        assert sbx.files.read(f"{work}/n{i}.txt") == str(i)
    assert time.monotonic() - started < 10


def test_large_upload_is_not_buffered(envd: Envd, sbx: Sandbox, work: Path) -> None:
    def high_water_kib() -> int:
        for line in Path(f"/proc/{envd.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    before = high_water_kib()
    chunk = b"\xab" * (1 << 20)
    sbx.files.write(f"{work}/huge.bin", (chunk for _ in range(64)))
    assert Path(work, "huge.bin").stat().st_size == 64 << 20
    assert high_water_kib() - before < 16 * 1024  # far below the 64 MiB that went through


def test_rejected_upload_still_gets_its_answer(envd: Envd, work: Path) -> None:
    response = httpx.post(
        envd.url + "/files",
        params={"path": f"{work}/nope.bin"},
        content=b"x" * (3 << 20),
        headers={"Content-Type": "application/octet-stream", "X-Access-Token": "wrong"},
    )
    assert response.status_code == 401
    assert not Path(work, "nope.bin").exists()


def test_duplicate_paths_in_one_upload(envd: Envd, work: Path) -> None:
    response = httpx.post(
        envd.url + "/files",
        files=[("file", (f"{work}/same.txt", b"1")), ("file", (f"{work}/same.txt", b"2"))],
        headers=envd.headers(),
    )
    assert response.status_code == 400 and "multiple files to the same path" in response.json()["message"]


def test_files_are_opened_with_the_users_credentials(sbx: Sandbox, work: Path) -> None:
    """The kernel decides, as for the user's own processes: its uid, its primary group and
    its supplementary groups (envd sets all three on its thread for the operation)."""
    secret, shared = work / "root-only.txt", work / "group-shared.txt"
    secret.write_text("s")
    os.chmod(secret, 0o600)
    shared.write_text("g")
    os.chown(shared, 0, grp.getgrnam(TEST_GROUP).gr_gid)  # the user is only a member
    os.chmod(shared, 0o640)
    with pytest.raises(SandboxException) as error:
        sbx.files.read(str(secret))
    assert "403" in str(error.value) and "Permission denied" in str(error.value), error.value
    with pytest.raises(SandboxException):
        sbx.files.write(str(secret), "overwritten")
    assert secret.read_text() == "s"
    assert sbx.files.read(str(shared)) == "g"  # through the supplementary group
    assert sbx.files.read(str(secret), user="root") == "s"  # root keeps full access
    # envd itself is root again after each operation: a root-only upload still works
    sbx.files.write(str(secret), "by root", user="root")
    assert secret.read_text() == "by root" and secret.stat().st_uid == 0
