"""Pulling images from a real registry into layers and templates: formats, whiteouts, auth,
corruption, resume, refusal of hostile archives. No sandboxes here (see test_pull_e2e.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from oci_helpers import (
    AUTH,
    BearerAuthFront,
    CuttingProxy,
    Entry,
    Image,
    Layer,
    Registry,
    digest_of,
    make_tar,
    random_bytes,
)

from aenv.config import Config, load_config
from aenv.errors import AenvError, ErrorCode
from aenv.images.layers import OPAQUE_XATTR, layer_id
from aenv.images.pull import ROOT_LAYER, ImagePuller
from aenv.images.reference import candidates, normalise, parse_reference
from aenv.orchestrator.store import Store
from aenv.storage.layout import Layout

# A file capability (cap_net_bind_service+ep), as `setcap` writes it: VFS_CAP_REVISION_2.
CAP_NET_BIND = bytes.fromhex("01000002" "00040000" "00000000" "00000000" "00000000")


def _layers_of(layout: Layout) -> set[str]:
    return {p.name for p in layout.layers_dir.iterdir()}


def merged_view(layers_top_first: list[Path]) -> dict[str, str]:
    """Mount the layers as overlayfs (in a private mount namespace) and describe every path:
    "d" for directories, "l:<target>" for symlinks, else the file's content."""
    script = (
        "set -e; m=$(mktemp -d); "
        f"mount -t overlay overlay -o lowerdir={':'.join(map(str, layers_top_first))} $m; "
        "cd $m; find . -mindepth 1 | sort | while read -r p; do "
        "if [ -L \"$p\" ]; then printf '%s\\tl:%s\\n' \"$p\" \"$(readlink \"$p\")\"; "
        "elif [ -d \"$p\" ]; then printf '%s\\td\\n' \"$p\"; "
        "else printf '%s\\t%s\\n' \"$p\" \"$(head -c 100 \"$p\" | tr '\\n' '|')\"; fi; done")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         check=True, capture_output=True, text=True).stdout
    view = dict(line[2:].split("\t", 1) for line in out.splitlines())
    return {path: value.rstrip("|") for path, value in view.items()}


# ---------------------------------------------------------------------------- references
def test_reference_normalisation() -> None:
    assert normalise("alpine", ["docker.io"]) == "docker.io/library/alpine:latest"
    assert normalise("python:3.12", ["docker.io"]) == "docker.io/library/python:3.12"
    assert normalise("org/app", ["docker.io"]) == "docker.io/org/app:latest"
    ref = parse_reference("127.0.0.1:5000/team/app:v1")
    assert (ref.registry, ref.repository, ref.tag) == ("127.0.0.1:5000", "team/app", "v1")
    assert parse_reference("localhost/app").registry == "localhost"
    pinned = parse_reference("ghcr.io/a/b@sha256:" + "a" * 64)
    assert pinned.reference == "sha256:" + "a" * 64
    assert parse_reference("docker.io/alpine").api_host == "registry-1.docker.io"
    assert [str(r) for r in candidates("app:1", ["reg.local:5000", "docker.io"])] == [
        "reg.local:5000/app:1", "docker.io/library/app:1"]
    for bad in ("", "UPPER/case", "a b", "app:bad tag", "app@sha256:xyz"):
        with pytest.raises(AenvError) as exc:
            candidates(bad, ["docker.io"])
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT


def test_images_config_from_file_and_env(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        '[images]\nsearch_registries = ["reg.local:5000", "docker.io"]\n'
        '[images.credentials."reg.local:5000"]\nusername = "u"\npassword = "p"\n')
    cfg = load_config({"AENV_HOME": str(tmp_path),
                       "AENV_IMAGES_INSECURE_REGISTRIES": "reg.local:5000, other:1"})
    assert cfg.images.search_registries == ["reg.local:5000", "docker.io"]
    assert cfg.images.insecure_registries == ["reg.local:5000", "other:1"]
    assert cfg.images.credentials == {"reg.local:5000": {"username": "u", "password": "p"}}
    assert cfg.images.allowed_registries == []


# ---------------------------------------------------------------------------- layers
def _rich_image() -> Image:
    bottom = Layer(make_tar([
        Entry("etc", "dir", mode=0o755),
        Entry("etc/keep", data=b"keep\n"),
        Entry("etc/gone", data=b"to be deleted\n"),
        Entry("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"),
        Entry("data", "dir", mode=0o755),
        Entry("data/old1", data=b"old1"),
        Entry("data/sub", "dir"),
        Entry("data/sub/old2", data=b"old2"),
        Entry("home/app", "dir", mode=0o750, uid=1000, gid=1000),
    ]), "gzip")
    top = Layer(make_tar([
        Entry("etc/gone", "whiteout"),
        Entry("data", "dir", mode=0o755),
        Entry("data", "opaque"),
        Entry("data/new", data=b"new"),
        Entry("bin", "dir", mode=0o755),
        Entry("bin/tool", data=b"#!/bin/sh\necho tool\n", mode=0o4755, uid=1000, gid=1000,
              mtime=1_600_000_000, xattrs={"user.note": b"hello", "security.capability": CAP_NET_BIND}),
        Entry("bin/tool-link", "hardlink", link="bin/tool"),
        Entry("bin/sh-link", "symlink", link="/bin/tool"),
        Entry("dev/null", "chardev"),  # skipped: sandboxes get their own /dev
    ]), "zstd")
    return Image([bottom, top], env=["PATH=/bin", "GREETING=hi there"], workdir="/data",
                 user="app")


async def test_multi_layer_whiteouts_opaque_hardlinks_xattrs(
        registry: Registry, puller: ImagePuller, layout: Layout, config: Config) -> None:
    image = _rich_image()
    registry.push_image("rich/app", "v1", image)
    events: list[dict[str, Any]] = []
    tpl = await puller.pull(f"{registry.host}/rich/app:v1", insecure=True,
                            progress=events.append)
    assert tpl.names == [f"{registry.host}/rich/app:v1"]
    ids = [layer_id(digest_of(layer.tar)) for layer in image.layers]
    assert tpl.layers == [ids[1], ids[0], ROOT_LAYER]  # top first, shared root layer last
    assert tpl.env_vars == {"PATH": "/bin", "GREETING": "hi there"}
    assert tpl.default_workdir == "/data" and tpl.default_user == "app"
    assert tpl.source_image is not None and tpl.source_image.startswith(f"{registry.host}/rich/app@sha256:")
    assert puller.store.find_template(tpl.names[0]) == tpl
    states = {e["state"] for e in events if e["type"] == "layer"}
    assert {"downloading", "extracting", "done"} <= states
    assert events[0]["type"] == "resolved" and events[0]["platform"] == "linux/amd64"

    top = layout.layer(ids[1])
    wh = os.lstat(top / "etc/gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(top / "data", OPAQUE_XATTR) == b"y"
    tool = os.lstat(top / "bin/tool")
    assert stat.S_IMODE(tool.st_mode) == 0o4755 and (tool.st_uid, tool.st_gid) == (1000, 1000)
    assert tool.st_mtime == 1_600_000_000 and tool.st_nlink == 2
    assert os.lstat(top / "bin/tool-link").st_ino == tool.st_ino
    assert os.getxattr(top / "bin/tool", "user.note") == b"hello"
    assert os.getxattr(top / "bin/tool", "security.capability") == CAP_NET_BIND
    assert os.readlink(top / "bin/sh-link") == "/bin/tool"
    assert not (top / "dev/null").exists()
    home = os.lstat(layout.layer(ids[0]) / "home/app")
    assert stat.S_IMODE(home.st_mode) == 0o750 and home.st_uid == 1000

    view = merged_view([layout.layer(i) for i in tpl.layers])
    assert "etc/gone" not in view and view["etc/keep"] == "keep"
    assert view["data/new"] == "new"
    assert "data/old1" not in view and "data/sub" not in view  # hidden by the opaque dir
    assert view["bin/sh-link"] == "l:/bin/tool"
    assert view["tmp"] == "d" and view["proc"] == "d"  # from the shared root layer

    # A second pull of the same image: nothing downloaded, layers shared, same template.
    again: list[dict[str, Any]] = []
    tpl2 = await puller.pull(f"{registry.host}/rich/app:v1", insecure=True, progress=again.append)
    assert tpl2.template_id == tpl.template_id
    assert {e["state"] for e in again if e["type"] == "layer"} == {"waiting", "exists"}
    assert not list((layout.cache_dir / "blobs").iterdir())  # blobs are not kept


async def test_index_picks_amd64_and_docker_schema2(registry: Registry, puller: ImagePuller,
                                                    layout: Layout) -> None:
    def arch_image(arch: str) -> Image:
        return Image([Layer(make_tar([Entry("arch", data=arch.encode())]), "gzip")],
                     architecture=arch, docker=arch == "amd64")

    registry.push_index("multi/arch", "latest", {a: arch_image(a) for a in ("arm64", "amd64", "s390x")})
    events: list[dict[str, Any]] = []
    tpl = await puller.pull(f"{registry.host}/multi/arch", name="multi", insecure=True,
                            progress=events.append)
    assert tpl.names == ["multi"] and tpl.default_user == "root"
    assert (layout.layer(tpl.layers[0]) / "arch").read_text() == "amd64"

    registry.push_index("multi/armonly", "latest", {"arm64": arch_image("arm64")})
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/multi/armonly", insecure=True)
    assert exc.value.code is ErrorCode.NOT_FOUND and "linux/arm64" in exc.value.message


async def test_short_names_search_registries_and_allow_list(
        registry: Registry, puller: ImagePuller, config: Config) -> None:
    registry.push_image("shorty", "1", Image([Layer(make_tar([Entry("f", data=b"x")]), "none")]))
    config.images.search_registries = ["127.0.0.1:1", registry.host]  # the first one is down
    config.images.insecure_registries = ["127.0.0.1:1", registry.host]
    with pytest.raises(AenvError) as exc:
        await puller.pull("shorty:1")
    assert exc.value.code is ErrorCode.UNAVAILABLE  # an unreachable registry is an answer
    config.images.search_registries = [registry.host]
    tpl = await puller.pull("shorty:1")
    assert tpl.names == [f"{registry.host}/shorty:1"]
    config.images.allowed_registries = ["registry.example.com"]
    with pytest.raises(AenvError, match="not in images.allowed_registries"):
        await puller.pull(f"{registry.host}/shorty:1")
    config.images.allowed_registries = []
    with pytest.raises(AenvError, match="--insecure"):  # https by default
        await puller.pull(f"{registry.host.replace('127.0.0.1', 'localhost')}/shorty:1")


async def test_name_conflicts_with_base_and_missing_images(
        registry: Registry, puller: ImagePuller, store: Store) -> None:
    from aenv.orchestrator.models import TemplateRecord

    store.put_template(TemplateRecord("base", ["base"], ["x"], 1, 256, 1024))
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/shorty:1", name="base", insecure=True)
    assert exc.value.code is ErrorCode.CONFLICT
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/no/such:image", insecure=True)
    assert exc.value.code is ErrorCode.NOT_FOUND and "MANIFEST_UNKNOWN" in exc.value.message


# ---------------------------------------------------------------------------- auth
async def test_basic_auth_registry(auth_registry: Registry, puller: ImagePuller,
                                   config: Config, tmp_path: Path) -> None:
    auth_registry.push_image("private/app", "1",
                             Image([Layer(make_tar([Entry("secret", data=b"42")]), "gzip")]))
    ref = f"{auth_registry.host}/private/app:1"
    with pytest.raises(AenvError) as exc:
        await puller.pull(ref, insecure=True)
    assert exc.value.code is ErrorCode.UNAUTHENTICATED and "credentials" in exc.value.message
    config.images.credentials = {auth_registry.host: {"username": AUTH[0], "password": "wrong"}}
    with pytest.raises(AenvError) as exc:
        await puller.pull(ref, insecure=True)
    assert exc.value.code is ErrorCode.UNAUTHENTICATED
    # Right credentials from a docker-style auth file.
    import base64

    auth_file = tmp_path / "docker-config.json"
    token = base64.b64encode(f"{AUTH[0]}:{AUTH[1]}".encode()).decode()
    auth_file.write_text(json.dumps({"auths": {auth_registry.host: {"auth": token}}}))
    config.images.credentials = {}
    config.images.auth_file = str(auth_file)
    tpl = await puller.pull(ref, insecure=True)
    assert (puller.layout.layer(tpl.layers[0]) / "secret").read_text() == "42"


# ---------------------------------------------------------------------------- integrity
def _blob_path(registry: Registry, digest: str) -> Path:
    hexpart = digest.split(":")[1]
    return registry.root / "data/docker/registry/v2/blobs/sha256" / hexpart[:2] / hexpart / "data"


async def test_corrupted_blob_is_refused_and_nothing_kept(
        registry: Registry, puller: ImagePuller, layout: Layout, store: Store) -> None:
    good = Layer(make_tar([Entry("ok", data=b"fine")]), "gzip")
    bad = Layer(make_tar([Entry("file", data=random_bytes(200_000, seed=7))]), "gzip")
    image = Image([good, bad])
    registry.push_image("corrupt/app", "1", image)
    path = _blob_path(registry, digest_of(bad.blob))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle: same size
    path.write_bytes(bytes(data))
    before = _layers_of(layout)
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/corrupt/app:1", insecure=True)
    assert exc.value.code is ErrorCode.DATA_LOSS
    assert digest_of(bad.blob) in exc.value.message and "nothing was kept" in exc.value.message
    assert layer_id(digest_of(bad.tar)) not in _layers_of(layout)
    assert not any(n.startswith(".") for n in _layers_of(layout) - before)  # no temp dirs
    # Nothing of the bad blob; at most the `.partial` of the good one, cancelled mid-way
    # when its sibling failed, kept for a later resume.
    left = [p.name for p in (layout.cache_dir / "blobs").iterdir()]
    assert all(n == digest_of(good.blob).replace(":", "-") + ".partial" for n in left), left
    assert store.find_template(f"{registry.host}/corrupt/app:1") is None


async def test_layer_that_does_not_match_its_diff_id(registry: Registry, puller: ImagePuller,
                                                     layout: Layout) -> None:
    layer = Layer(make_tar([Entry("a", data=b"a")]), "gzip")
    image = Image([layer])
    image.config = lambda: json.dumps({  # type: ignore[method-assign]
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}).encode()
    registry.push_image("lying/config", "1", image)
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/lying/config:1", insecure=True)
    assert exc.value.code is ErrorCode.DATA_LOSS and "config says" in exc.value.message
    assert layer_id("sha256:" + "0" * 64) not in _layers_of(layout)


@pytest.mark.parametrize("entries, problem", [
    ([Entry("../evil", data=b"x")], "escapes"),
    ([Entry("/abs", data=b"x")], "absolute"),
    ([Entry("link", "symlink", link="/tmp"), Entry("link/evil", data=b"x")], "non-directory"),
    ([Entry("link", "symlink", link="/etc"), Entry("h", "hardlink", link="link/passwd")],
     "non-directory"),
    ([Entry("d", "dir"), Entry("d/x", data=b"x"), Entry("d/.wh..", data=b"")], "invalid whiteout"),
    # A directory replaced by a symlink to the host: what was known about it is forgotten.
    ([Entry("d", "dir"), Entry("d/sub", "dir"), Entry("d", "symlink", link="/tmp"),
      Entry("d/sub/evil", data=b"x")], "non-directory"),
])
async def test_hostile_archives_are_refused(registry: Registry, puller: ImagePuller,
                                            layout: Layout, entries: list[Entry],
                                            problem: str) -> None:
    image = Image([Layer(make_tar(entries), "gzip")])
    repo = f"hostile/t{abs(hash(problem + entries[-1].path)) % 10**6}"
    registry.push_image(repo, "1", image)
    before = _layers_of(layout) if layout.layers_dir.exists() else set()
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/{repo}:1", insecure=True)
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT and problem in exc.value.message
    assert _layers_of(layout) - before <= {ROOT_LAYER}
    assert not Path("/tmp/evil").exists()


async def test_interrupted_download_resumes_with_range(registry: Registry, puller: ImagePuller,
                                                       layout: Layout) -> None:
    payload = random_bytes(3 << 20, seed=3)
    layer = Layer(make_tar([Entry("big.bin", data=payload)]), "none")
    registry.push_image("resume/app", "1", Image([layer]))
    proxy = CuttingProxy(("127.0.0.1", registry.port), cut_after=1 << 20)
    try:
        tpl = await puller.pull(f"{proxy.host}/resume/app:1", name="resumed", insecure=True)
    finally:
        proxy.close()
    assert proxy.cuts == 1
    heads = b"".join(proxy.requests)
    assert b"Range: bytes=" in heads or b"range: bytes=" in heads
    assert (layout.layer(tpl.layers[0]) / "big.bin").read_bytes() == payload


async def test_bearer_token_flow(registry: Registry, puller: ImagePuller, config: Config) -> None:
    registry.push_image("tokened/app", "1", Image([Layer(make_tar([Entry("t", data=b"ok")]), "gzip")]))
    front = BearerAuthFront(registry.host, AUTH)
    try:
        ref = f"{front.host}/tokened/app:1"
        with pytest.raises(AenvError) as exc:  # an anonymous token does not open it
            await puller.pull(ref, insecure=True)
        assert exc.value.code is ErrorCode.UNAUTHENTICATED
        config.images.credentials = {front.host: {"username": AUTH[0], "password": AUTH[1]}}
        front.token_requests.clear()
        tpl = await puller.pull(ref, insecure=True)
        assert (puller.layout.layer(tpl.layers[0]) / "t").read_text() == "ok"
        # One token for the whole pull (manifest, config, layers), scoped to the repository.
        assert front.token_requests == [{"scope": "repository:tokened/app:pull",
                                         "service": "aenv-test"}]
    finally:
        front.close()


async def test_concurrent_pulls_share_layers(registry: Registry, puller: ImagePuller,
                                             layout: Layout) -> None:
    import asyncio

    big = random_bytes(5 << 20, seed=11)  # above the size written by the writer threads
    shared = Layer(make_tar([Entry("shared.bin", data=big), Entry("again", data=b"1"),
                             Entry("again", data=b"2"),  # repeated names: the last one wins
                             Entry("small", data=b"s"), Entry("hard", "hardlink", link="small"),
                             Entry("bighard", "hardlink", link="shared.bin")]), "gzip")
    a = Image([shared, Layer(make_tar([Entry("who", data=b"a")]), "gzip")])
    b = Image([shared, Layer(make_tar([Entry("who", data=b"b")]), "zstd")])
    registry.push_image("shared/a", "1", a)
    registry.push_image("shared/b", "1", b)
    ta, tb = await asyncio.gather(puller.pull(f"{registry.host}/shared/a:1", insecure=True),
                                  puller.pull(f"{registry.host}/shared/b:1", insecure=True))
    assert ta.layers[1] == tb.layers[1] == layer_id(digest_of(shared.tar))
    assert ta.template_id != tb.template_id
    assert (layout.layer(ta.layers[0]) / "who").read_text() == "a"
    assert (layout.layer(tb.layers[0]) / "who").read_text() == "b"
    lower = layout.layer(ta.layers[1])
    assert (lower / "bighard").read_bytes() == big and (lower / "again").read_text() == "2"
    assert (lower / "hard").stat().st_ino == (lower / "small").stat().st_ino
    assert not [p for p in layout.layers_dir.iterdir() if p.name.startswith(".")]


async def test_single_platform_image_for_another_cpu(registry: Registry, puller: ImagePuller) -> None:
    registry.push_image("arm/only", "1", Image([Layer(make_tar([Entry("f", data=b"x")]), "gzip")],
                                               architecture="arm64"))
    with pytest.raises(AenvError) as exc:
        await puller.pull(f"{registry.host}/arm/only:1", insecure=True)
    assert exc.value.code is ErrorCode.NOT_SUPPORTED and "linux/arm64" in exc.value.message
