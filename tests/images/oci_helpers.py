"""Test images built from scratch (no internet): tar layers, OCI/Docker manifests and indexes,
pushed with the distribution API (monolithic PUT uploads) to a real `docker-registry`
started on loopback by the suite; plus a TCP proxy that cuts a connection once, for resume
tests.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import io
import json
import random
import socket
import subprocess
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard

from aenv.devserver import free_port

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
LAYER_TYPES = {
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
    "none": "application/vnd.oci.image.layer.v1.tar",
    "docker-gzip": "application/vnd.docker.image.rootfs.diff.tar.gzip",
}


AUTH = ("alice", "s3cret-pass")  # the basic-auth registry's user


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------ layers
@dataclass
class Entry:
    """One tar entry. kind: file | dir | symlink | hardlink | whiteout | opaque | chardev."""

    path: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    link: str = ""
    mtime: int = 1_700_000_000
    xattrs: dict[str, bytes] = field(default_factory=dict)


def make_tar(entries: Iterable[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            name = e.path
            if e.kind == "whiteout":
                head, _, base = name.rpartition("/")
                name = f"{head}/.wh.{base}" if head else f".wh.{base}"
            elif e.kind == "opaque":
                name = f"{name.rstrip('/')}/.wh..wh..opq"
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, e.mtime
            data = None
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.link
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.link
            elif e.kind == "chardev":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            else:  # file, whiteout, opaque
                info.size = len(e.data)
                data = io.BytesIO(e.data)
            if e.xattrs:
                # What Docker/BuildKit write; tarfile reads them back as PAX strings.
                info.pax_headers = {f"SCHILY.xattr.{k}": v.decode("utf-8", "surrogateescape")
                                    for k, v in e.xattrs.items()}
            tar.addfile(info, data)
    return buf.getvalue()


def tar_directory(root: Path, arcname: str = ".") -> bytes:
    """A layer from a directory tree (e.g. the base template's layer)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(root, arcname=arcname)
    return buf.getvalue()


def compress(tar: bytes, kind: str) -> bytes:
    if kind in ("gzip", "docker-gzip"):
        return gzip.compress(tar, compresslevel=1, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(tar)
    return tar


@dataclass
class Layer:
    tar: bytes
    compression: str = "gzip"
    blob: bytes = b""

    def __post_init__(self) -> None:
        if not self.blob:
            self.blob = compress(self.tar, self.compression)

    @property
    def media_type(self) -> str:
        return LAYER_TYPES[self.compression]


@dataclass
class Image:
    layers: list[Layer]
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/local/bin:/usr/bin:/bin"])
    workdir: str = ""
    user: str = ""
    architecture: str = "amd64"
    docker: bool = False  # Docker schema2 media types instead of OCI

    def config(self) -> bytes:
        return json.dumps({
            "architecture": self.architecture, "os": "linux",
            "config": {"Env": self.env, "WorkingDir": self.workdir, "User": self.user},
            "rootfs": {"type": "layers",
                       "diff_ids": [digest_of(layer.tar) for layer in self.layers]},
        }).encode()

    def manifest(self) -> bytes:
        cfg = self.config()
        return json.dumps({
            "schemaVersion": 2, "mediaType": DOCKER_MANIFEST if self.docker else OCI_MANIFEST,
            "config": {"mediaType": DOCKER_CONFIG if self.docker else OCI_CONFIG,
                       "digest": digest_of(cfg), "size": len(cfg)},
            "layers": [{"mediaType": LAYER_TYPES["docker-gzip"] if self.docker else
                        layer.media_type, "digest": digest_of(layer.blob),
                        "size": len(layer.blob)} for layer in self.layers],
        }).encode()

    @property
    def media_type(self) -> str:
        return DOCKER_MANIFEST if self.docker else OCI_MANIFEST


# ------------------------------------------------------------------------------ registry
@dataclass
class Registry:
    """A real `docker-registry` (distribution 2.8) on loopback, filesystem storage."""

    root: Path
    auth: tuple[str, str] | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> Registry:
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = ["version: 0.1", "log:", "  level: error", "storage:", "  filesystem:",
               f"    rootdirectory: {self.root / 'data'}", "  delete:", "    enabled: true",
               "http:", f"  addr: {self.host}", "  secret: aenv-test"]
        if self.auth is not None:
            htpasswd = self.root / "htpasswd"
            out = subprocess.run(["htpasswd", "-Bbn", *self.auth], check=True,
                                 capture_output=True)
            htpasswd.write_bytes(out.stdout)
            cfg += ["auth:", "  htpasswd:", "    realm: aenv-test", f"    path: {htpasswd}"]
        (self.root / "config.yml").write_text("\n".join(cfg) + "\n")
        log = open(self.root / "registry.log", "ab")  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen(["/usr/bin/docker-registry", "serve",
                                      str(self.root / "config.yml")], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/v2/", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise TimeoutError("docker-registry did not start; see " + str(self.root / "registry.log"))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, auth=self.auth, timeout=120)

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = digest_of(data)
        with self.client() as http:
            if http.head(f"/v2/{repo}/blobs/{digest}").status_code == 200:
                return digest
            resp = http.post(f"/v2/{repo}/blobs/uploads/")
            assert resp.status_code == 202, resp.text
            location = resp.headers["Location"]
            sep = "&" if "?" in location else "?"
            resp = http.put(f"{location}{sep}digest={digest}", content=data,
                            headers={"Content-Type": "application/octet-stream"})
            assert resp.status_code == 201, resp.text
        return digest

    def push_manifest(self, repo: str, ref: str, data: bytes, media_type: str) -> str:
        with self.client() as http:
            resp = http.put(f"/v2/{repo}/manifests/{ref}", content=data,
                            headers={"Content-Type": media_type})
            assert resp.status_code == 201, resp.text
        return digest_of(data)

    def push_image(self, repo: str, tag: str, image: Image) -> str:
        """Push blobs, config and manifest; returns the manifest digest."""
        for layer in image.layers:
            self.push_blob(repo, layer.blob)
        self.push_blob(repo, image.config())
        return self.push_manifest(repo, tag, image.manifest(), image.media_type)

    def push_index(self, repo: str, tag: str, images: dict[str, Image]) -> str:
        """An OCI index of per-architecture images (key: architecture)."""
        manifests: list[dict[str, Any]] = []
        for arch, image in images.items():
            digest = self.push_image(repo, f"tmp-{arch}", image)
            manifests.append({"mediaType": image.media_type, "digest": digest,
                              "size": len(image.manifest()),
                              "platform": {"os": "linux", "architecture": arch}})
        body = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                           "manifests": manifests}).encode()
        return self.push_manifest(repo, tag, body, OCI_INDEX)


# ------------------------------------------------------------------------------ faults
class CuttingProxy:
    """A TCP proxy to `target` that closes the first connection carrying more than
    `cut_after` bytes of responses, mid-body; later connections pass through untouched.
    Records the request heads it forwarded (to check for Range headers)."""

    def __init__(self, target: tuple[str, int], cut_after: int) -> None:
        self.target = target
        self.cut_after = cut_after
        self.cuts = 0
        self.requests: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(client, upstream), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:
                    self.requests.append(data)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _down(self, client: socket.socket, upstream: socket.socket) -> None:
        passed = 0
        try:
            while data := upstream.recv(65536):
                with self._lock:
                    cut = self.cuts == 0 and passed + len(data) > self.cut_after
                    if cut:
                        self.cuts += 1
                if cut:
                    client.sendall(data[: max(0, self.cut_after - passed)])
                    break
                client.sendall(data)
                passed += len(data)
        except OSError:
            pass
        finally:
            # RST rather than FIN would also do; a plain close is what a dying peer looks like.
            _close(client)
            _close(upstream)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def random_bytes(n: int, seed: int = 1) -> bytes:
    # Incompressible but reproducible: digests stay stable between runs.
    return random.Random(seed).randbytes(n)


class BearerAuthFront:
    """The Docker Hub style auth flow in front of a registry: /v2/ answers 401 with a
    `Bearer realm=...,service=...,scope=...` challenge; the realm hands out tokens for
    `credentials` (basic auth) and useless anonymous ones otherwise; requests with a good
    token are forwarded to the registry."""

    def __init__(self, target: str, credentials: tuple[str, str]) -> None:
        self.target = target
        self.credentials = credentials
        self.token_requests: list[dict[str, str]] = []
        self._good = "tok-" + hashlib.sha256(repr(credentials).encode()).hexdigest()[:16]
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_GET(self) -> None:
                front.handle(self)

            def do_HEAD(self) -> None:
                front.handle(self)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def handle(self, req: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        if url.path == "/token":
            query = dict(urllib.parse.parse_qsl(url.query))
            self.token_requests.append(query)
            expected = "Basic " + base64.b64encode(":".join(self.credentials).encode()).decode()
            token = self._good if req.headers.get("Authorization") == expected else "anonymous"
            self._reply(req, 200, {"Content-Type": "application/json"},
                        json.dumps({"token": token}).encode())
            return
        if req.headers.get("Authorization") != f"Bearer {self._good}":
            repo = url.path.removeprefix("/v2/").rsplit("/", 2)[0]
            challenge = (f'Bearer realm="http://{self.host}/token",service="aenv-test",'
                         f'scope="repository:{repo}:pull"')
            self._reply(req, 401, {"WWW-Authenticate": challenge,
                                   "Content-Type": "application/json"},
                        b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}')
            return
        headers = {k: v for k, v in req.headers.items() if k.lower() in ("accept", "range")}
        resp = httpx.request(req.command, f"http://{self.target}{req.path}", headers=headers,
                             timeout=60)
        keep = ("content-type", "docker-content-digest", "content-range", "etag")
        self._reply(req, resp.status_code,
                    {k: v for k, v in resp.headers.items() if k.lower() in keep}, resp.content)

    @staticmethod
    def _reply(req: http.server.BaseHTTPRequestHandler, status: int, headers: dict[str, str],
               body: bytes) -> None:
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(body)


def busybox_rootfs(*tools: str) -> list[Entry]:
    """A minimal userland: the host's static busybox (`make install` installs busybox-static),
    `tools` as links to it, and root in /etc/passwd and /etc/group."""
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        pytest.fail("busybox-static is not installed: run `make install`")
    return [Entry("bin", "dir", mode=0o755),
            Entry("bin/busybox", data=busybox.read_bytes(), mode=0o755),
            *(Entry(f"bin/{tool}", "symlink", link="busybox") for tool in tools),
            Entry("etc", "dir", mode=0o755),
            Entry("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n"),
            Entry("etc/group", data=b"root:x:0:\n")]
