"""Template builds without a server: the Dockerfile subset `aenv build` parses, and Docker's
COPY/ADD placement rules on an uploaded build-context archive."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from aenv.builds.context import Owner, place
from aenv.builds.dockerfile import DockerfileError, parse
from aenv.errors import AenvError

OWNER = Owner(1001, 1002, "builder", "staff")


def test_dockerfile_subset() -> None:
    parsed = parse(
        "# comment\n"
        "ARG EARLY=1\n"
        "FROM python:3.12 AS app\n"
        "ARG WHO=world\n"
        "ENV A=1 B=\"two words\" C=${WHO}\n"
        "ENV LEGACY value with spaces\n"
        "WORKDIR /opt/$WHO\n"
        "COPY --chown=user:user --chmod=755 a.txt b/ /dst/\n"
        "ADD [\"pkg.tar.gz\", \"/opt/pkg\"]\n"
        "RUN apt-get update \\\n"
        "    # inside a continuation\n"
        "    && echo $WHO\n"
        "RUN [\"echo\", \"exec form\"]\n"
        "USER user\n"
        "EXPOSE 8080\n"
        "ENTRYPOINT [\"python3\", \"-m\"]\n"
        "CMD http.server\n",
        build_args={"WHO": "there"})
    assert parsed.from_image == "python:3.12"
    assert parsed.start_cmd == "python3 -m http.server"
    assert parsed.warnings == ["line 15: EXPOSE is ignored"]
    assert parsed.steps == [
        {"type": "ARG", "args": ["WHO", "there"]},
        {"type": "ENV", "args": ["A", "1", "B", "two words", "C", "there"]},
        {"type": "ENV", "args": ["LEGACY", "value with spaces"]},
        {"type": "WORKDIR", "args": ["/opt/there"]},
        {"type": "COPY", "args": ["a.txt", "/dst/", "user:user", "0755"]},
        {"type": "COPY", "args": ["b/", "/dst/", "user:user", "0755"]},
        {"type": "ADD", "args": ["pkg.tar.gz", "/opt/pkg", "", ""]},
        {"type": "RUN", "args": ["apt-get update      && echo $WHO"]},
        {"type": "RUN", "args": ["echo 'exec form'"]},
        {"type": "USER", "args": ["user"]},
    ]


@pytest.mark.parametrize("text, needle", [
    ("RUN x\n", "before FROM"),
    ("FROM a\nFROM b\n", "multi-stage"),
    ("FROM a\nCOPY --from=x a b\n", "--from"),
    ("FROM a\nCOPY a b c\n", "ending in /"),
    ("FROM a\nADD https://x/y /z\n", "URL"),
    ("FROM a\nCOPY ../secret /x\n", "outside"),
    ("FROM a\nFROBNICATE\n", "unknown instruction"),
    ("", "no FROM"),
])
def test_dockerfile_errors(text: str, needle: str) -> None:
    with pytest.raises(DockerfileError, match=needle):
        parse(text)


def _archive(path: Path, files: dict[str, bytes | None], gz: bool = True) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.uid, info.gid, info.mode = 4242, 4242, 0o644
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _placed(out: Path) -> dict[str, tuple[str, int, int, int]]:
    with tarfile.open(out) as tar:
        return {m.name: ("d" if m.isdir() else "f", m.uid, m.gid, m.mode) for m in tar}


CONTEXT = {"hello.txt": b"hi", "app": None, "app/main.py": b"print()", "app/lib": None,
           "app/lib/u.py": b"x", "notes.md": b"n"}


@pytest.mark.parametrize("src, dest, dest_is_dir, expected", [
    ("hello.txt", "/opt/hello.txt", False, ["opt/hello.txt"]),
    ("hello.txt", "/opt/", False, ["opt/hello.txt"]),
    ("hello.txt", "/opt", True, ["opt/hello.txt"]),
    ("app", "/srv/code", False, ["srv/code", "srv/code/lib", "srv/code/lib/u.py",
                                 "srv/code/main.py"]),
    ("app/lib/", "/x/", False, ["x", "x/u.py"]),
    ("*.txt", "/d/", False, ["d/hello.txt"]),
    # Docker: a directory a glob matches has its contents copied, not itself.
    ("*", "/d/", False, ["d", "d/hello.txt", "d/lib", "d/lib/u.py", "d/main.py",
                         "d/notes.md"]),
    (".", "/all", False, ["all/app", "all/app/lib", "all/app/lib/u.py", "all/app/main.py",
                          "all/hello.txt", "all/notes.md"]),
])
def test_copy_placement(tmp_path: Path, src: str, dest: str, dest_is_dir: bool,
                        expected: list[str]) -> None:
    archive = _archive(tmp_path / "ctx.tar.gz", CONTEXT)
    out = tmp_path / "out.tar"
    assert place(archive, out, src, dest, dest_is_dir, OWNER, 0o600 if src == "*.txt" else None
                 ) == len(expected)
    placed = _placed(out)
    assert sorted(placed) == expected
    assert all((uid, gid) == (1001, 1002) for _, uid, gid, _ in placed.values())
    if src == "*.txt":
        assert placed["d/hello.txt"][3] == 0o600


def test_add_unpacks_archives(tmp_path: Path) -> None:
    inner = _archive(tmp_path / "pkg.tar.gz", {"pkg": None, "pkg/a.txt": b"a"})
    archive = tmp_path / "ctx.tar"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(inner, arcname="pkg.tar.gz")
    out = tmp_path / "out.tar"
    place(archive, out, "pkg.tar.gz", "/opt/", False, OWNER, None, unpack_archives=True)
    assert sorted(_placed(out)) == ["opt/pkg", "opt/pkg/a.txt"]
    place(archive, out, "pkg.tar.gz", "/opt/", False, OWNER, None, unpack_archives=False)
    assert sorted(_placed(out)) == ["opt/pkg.tar.gz"]


def test_copy_refusals(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "ctx.tar.gz", CONTEXT)
    with pytest.raises(AenvError, match="no files"):
        place(archive, tmp_path / "o.tar", "missing.txt", "/x", False, OWNER)
    with pytest.raises(AenvError, match="outside"):
        place(archive, tmp_path / "o.tar", "../x", "/x", False, OWNER)
    with pytest.raises(AenvError, match="absolute"):
        place(archive, tmp_path / "o.tar", "hello.txt", "rel", False, OWNER)
    hostile = _archive(tmp_path / "bad.tar", {"../../etc/passwd": b"x"}, gz=False)
    with pytest.raises(AenvError, match="outside"):
        place(hostile, tmp_path / "o.tar", "*", "/x/", False, OWNER)
    (tmp_path / "junk").write_bytes(b"not a tar")
    with pytest.raises(AenvError, match="not a tar"):
        place(tmp_path / "junk", tmp_path / "o.tar", "*", "/x/", False, OWNER)
