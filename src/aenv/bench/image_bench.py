"""Time from `aenv pull` to the first sandbox ready, for a ~350 MB image (the base template's
Debian layer plus a small layer, zstd, pushed to a loopback `docker-registry`):

- **full pull**: download, verify and unpack every layer, then create a sandbox;
- **on demand**: the same image on a second node whose layers were converted into the shared
  snapshot repository by the first (`images.convert_layers`; its cost is printed too): the
  pull fetches the layer manifests only, the sandbox starts on the FUSE layer and fetches what
  it reads (`images.on_demand`).

Each round uses a fresh AENV_HOME and server (nothing local). "Ready" is `Sandbox.create`
returning (envd answered) plus one command reading a file of the image.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import zstandard

from aenv.devserver import ServerProcess, base_layer, free_port, prepare_home, remove_home, sdk_server

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ZSTD_LAYER = "application/vnd.oci.image.layer.v1.tar+zstd"
SMALL_POOLS = {"AENV_RUNTIME_READY_POOL": "0", "AENV_RUNTIME_WARM_POOL": "2",
               "AENV_RUNTIME_WARM_PROCESSES": "2"}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar(root: Path | None, files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if root is not None:
            tar.add(root, arcname=".")
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _push(url: str, repo: str, tag: str, tars: list[bytes]) -> None:
    blobs = [zstandard.ZstdCompressor(level=3).compress(t) for t in tars]
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": [_digest(t) for t in tars]}
                         }).encode()
    with httpx.Client(base_url=url, timeout=300) as http:
        for data in [*blobs, config]:
            loc = http.post(f"/v2/{repo}/blobs/uploads/").headers["Location"]
            sep = "&" if "?" in loc else "?"
            http.put(f"{loc}{sep}digest={_digest(data)}", content=data,
                     headers={"Content-Type": "application/octet-stream"}).raise_for_status()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": ZSTD_LAYER, "digest": _digest(b), "size": len(b)}
                       for b in blobs]}).encode()
        http.put(f"/v2/{repo}/manifests/{tag}", content=manifest,
                 headers={"Content-Type": OCI_MANIFEST}).raise_for_status()


def _registry(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    host = f"127.0.0.1:{free_port()}"
    (root / "config.yml").write_text("\n".join([
        "version: 0.1", "log:", "  level: error", "storage:", "  filesystem:",
        f"    rootdirectory: {root / 'data'}", "http:", f"  addr: {host}"]) + "\n")
    proc = subprocess.Popen(["/usr/bin/docker-registry", "serve", str(root / "config.yml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(400):
        try:
            httpx.get(f"http://{host}/v2/", timeout=1)
            return proc, host
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError("docker-registry did not start")


def _pull_and_start(extra_env: dict[str, str], image: str, lazy_layer: str | None
                    ) -> tuple[float, float, str]:
    """(pull seconds, pull-to-ready seconds, note) on a fresh node."""
    from e2b import Sandbox

    with sdk_server("aenv-bench-image-", {**SMALL_POOLS, **extra_env}) as server:
        env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "aenv.cli.main", "pull", image, "--insecure",
                        "--name", "bench-image"], env=env, check=True, capture_output=True)
        pulled = time.perf_counter() - t0
        sbx = Sandbox.create("bench-image", timeout=120)
        out = sbx.commands.run("head -1 /etc/os-release").stdout
        ready = time.perf_counter() - t0
        assert out.startswith("PRETTY_NAME"), out
        note = ""
        if lazy_layer is not None:
            stats = json.loads((server.home / "cache/lazy" / lazy_layer / "stats.json").read_text())
            note = (f"; {stats['fetched_bytes'] / 1e6:.1f} of {stats['total_bytes'] / 1e6:.0f} "
                    "MB of the big layer fetched")
        sbx.kill()
        return pulled, ready, note


def _convert(image: str, repo_dir: Path, bottom: str) -> float:
    """A first node pulls (and converts in the background); seconds until converted."""
    home = prepare_home("aenv-bench-convert-")
    server = ServerProcess(home=home, extra_env={
        **SMALL_POOLS, "AENV_SNAPSHOT_PATH": str(repo_dir), "AENV_IMAGES_CONVERT_LAYERS": "1"})
    try:
        server.start(ready_timeout=300)
        env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "aenv.cli.main", "pull", image, "--insecure"],
                       env=env, check=True, capture_output=True)
        pulled = time.perf_counter() - t0
        marker = repo_dir / "meta" / "manifests" / f"lazy-{bottom}.json"
        while not marker.exists():  # the posix_fs repository's manifest, written last
            if time.perf_counter() - t0 > 900:
                raise TimeoutError("conversion did not finish")
            time.sleep(0.2)
        return time.perf_counter() - t0 - pulled
    finally:
        server.shutdown()
        remove_home(home)


def run(rounds: int) -> Iterator[str]:
    from aenv.images.layers import layer_id

    work = Path(tempfile.mkdtemp(prefix="aenv-bench-registry-"))
    proc, host = _registry(work)
    try:
        t = time.perf_counter()
        bottom_tar = _tar(base_layer(), {})
        top_tar = _tar(None, {"etc/aenv-bench.txt": b"bench\n"})
        _push(f"http://{host}", "bench/debian", "12", [bottom_tar, top_tar])
        image = f"{host}/bench/debian:12"
        bottom = layer_id(_digest(bottom_tar))
        yield (f"image: {len(bottom_tar) / 1e6:.0f} MB uncompressed (built and pushed in "
               f"{time.perf_counter() - t:.0f} s)")
        del bottom_tar
        for i in range(rounds):
            pulled, ready, _ = _pull_and_start({}, image, None)
            yield (f"{'full pull':<12} round {i + 1}: aenv pull {pulled:6.2f} s, "
                   f"pull -> first sandbox ready {ready:6.2f} s")
        repo_dir = work / "repository"
        yield f"conversion on a first node (after its pull): {_convert(image, repo_dir, bottom):.1f} s"
        for i in range(rounds):
            pulled, ready, note = _pull_and_start(
                {"AENV_SNAPSHOT_PATH": str(repo_dir), "AENV_IMAGES_ON_DEMAND": "1",
                 "AENV_IMAGES_ON_DEMAND_PREFETCH_S": "-1"}, image, bottom)
            yield (f"{'on demand':<12} round {i + 1}: aenv pull {pulled:6.2f} s, "
                   f"pull -> first sandbox ready {ready:6.2f} s{note}")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.bench.image_bench")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    print("image pull -> first sandbox ready (~350 MB image), with and without on-demand layers")
    for line in run(args.rounds):
        print("  " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
