"""Pulling an OCI image into a template: resolve -> manifest -> config -> layers -> template.

Owns: the order of a pull and its progress events; choosing the platform from an image
index; turning the image config (Env, WorkingDir, User, rootfs.diff_ids) into a
`TemplateRecord` whose `layers` are the image's layers TOP FIRST over the shared
`aenv-image-root` layer; registering it in the store.
Must not touch: sandboxes, the base template, snapshot templates (a pull never replaces
either), other layers than the ones it creates.

Every unpacked layer is entered in the bounded layer cache (`images/cache.py`) with the image
it came from; `ensure_layers` fetches layers the cache evicted again (a create from a
template waits for it), and every pull or re-fetch ends with an eviction pass. With
`images.on_demand`, a layer converted into the snapshot repository is attached lazily
instead of downloaded (`images/lazy.py`); with `images.convert_layers`, unpacked layers are
converted in the background.

Layers download concurrently (`images.max_concurrent_downloads`) and unpack in threads
(`images.max_concurrent_unpacks`); one that is already unpacked is neither downloaded nor
unpacked again. Progress events are dicts (see docs/api.md, "Images"):
  {"type": "resolved", "image", "digest", "platform", "layers": [{"digest", "size"}]}
  {"type": "layer", "digest", "state", "total", "done"}   state: waiting | downloading |
      verifying | extracting | done | exists
  {"type": "template", "template": {...}}                  last event of a successful pull
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode, invalid
from aenv.images import layers as layerfs
from aenv.images.cache import LayerCache, is_cached_layer, layer_present, tree_bytes
from aenv.images.lazy import LazyLayers
from aenv.images.reference import ImageRef, candidates, normalise, parse_reference
from aenv.images.registry import INDEX_TYPES, Manifest, RegistryClient, check_digest
from aenv.orchestrator.models import TemplateRecord
from aenv.orchestrator.store import Store
from aenv.storage.layout import Layout

log = logging.getLogger("aenv.images")

ProgressSink = Callable[[dict[str, Any]], None]

# A tiny shared layer under every image: the directories a sandbox root needs (the container
# runtime mounts /dev, /proc, /sys there and envd wants a /tmp), so that images without them
# (scratch, busybox-only) start without copying up into each sandbox's writable layer.
ROOT_LAYER = "aenv-image-root-v1"
_ROOT_DIRS = (("dev", 0o755), ("proc", 0o555), ("sys", 0o555), ("tmp", 0o1777), ("etc", 0o755),
              ("root", 0o700), ("run", 0o755), ("home", 0o755))
PARTIAL_BLOB_MAX_AGE_S = 24 * 3600
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def host_platform() -> tuple[str, str]:
    return "linux", _GOARCH.get(platform.machine().lower(), platform.machine().lower())


@dataclass(frozen=True)
class _Layer:
    digest: str
    size: int | None
    media_type: str
    diff_id: str

    @property
    def layer_id(self) -> str:
        return layerfs.layer_id(self.diff_id)


def ensure_root_layer(layers_dir: Path) -> Path:
    """The shared `aenv-image-root` layer, made once (atomically, like every layer)."""
    final = layers_dir / ROOT_LAYER
    if final.is_dir():
        return final
    tmp = layers_dir / f".{ROOT_LAYER}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True, mode=0o755)
    for name, mode in _ROOT_DIRS:
        (tmp / name).mkdir()
        (tmp / name).chmod(mode)
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        for name, _ in _ROOT_DIRS:
            (tmp / name).rmdir()
        tmp.rmdir()
    return final


class ImagePuller:
    """Pulls images for one server (one layout, one store). Holds per-blob locks so that two
    concurrent pulls sharing a layer download and unpack it once."""

    def __init__(self, config: Config, layout: Layout, store: Store,
                 cache: LayerCache | None = None, lazy: LazyLayers | None = None) -> None:
        self.config = config
        self.layout = layout
        self.store = store
        self.lazy = lazy  # on-demand layers (None: every layer is downloaded and unpacked)
        # A server passes a cache whose `in_use` asks the manager; without one (tools, tests)
        # only the layers of this puller's own operations are protected from eviction.
        self.cache = cache or LayerCache(layout.layers_dir, layout.cache_dir / "oci-layers.json",
                                         config.images.cache_bytes, lazy=lazy)
        self._conversions: set[asyncio.Task[None]] = set()
        self.blobs_dir = layout.cache_dir / "blobs"
        self._locks: dict[str, asyncio.Lock] = {}
        self._downloads = asyncio.Semaphore(max(1, config.images.max_concurrent_downloads))
        self._unpacks = asyncio.Semaphore(max(1, config.images.max_concurrent_unpacks))

    def sweep(self) -> None:
        """Blocking, at server start: remove what crashed pulls left (temporary layer dirs).
        Partial blobs are kept for a day: a pull of the same blob resumes them."""
        layerfs.sweep_partial(self.layout.layers_dir)
        if self.lazy is not None and self.config.images.on_demand:
            self.lazy.start()  # before the runtime forks sandbox processes: they must see it
        self.cache.load()

    async def close(self) -> None:
        """Stop conversions; unmount the on-demand layers unless a sandbox still runs on one
        (sandboxes outlive the server; the next server reuses the mount)."""
        for task in list(self._conversions):
            task.cancel()
        await asyncio.gather(*self._conversions, return_exceptions=True)
        self.cache.flush()
        if self.lazy is not None and self.config.images.on_demand:
            protected = self.cache.protected()
            if not any((e := self.cache.entry(layer)) is not None and e.lazy
                       for layer in protected):
                await asyncio.to_thread(self.lazy.stop)

    async def wait_conversions(self) -> None:
        """Wait until background conversions (`images.convert_layers`) are finished."""
        while self._conversions:
            await asyncio.gather(*self._conversions, return_exceptions=True)
        if self.blobs_dir.is_dir():
            for entry in self.blobs_dir.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - entry.stat().st_mtime > PARTIAL_BLOB_MAX_AGE_S:
                        entry.unlink()

    def check(self, image: str, name: str | None) -> str:
        """Validate a pull request before any network traffic; returns the template name."""
        search = self.config.images.search_registries
        candidates(image, search)
        template_name = name or normalise(image, search)
        self._check_name(template_name)
        return template_name

    async def pull(self, image: str, name: str | None = None, insecure: bool = False,
                   progress: ProgressSink | None = None) -> TemplateRecord:
        emit: ProgressSink = progress or (lambda _: None)
        template_name = self.check(image, name)
        refs = candidates(image, self.config.images.search_registries)
        async with RegistryClient(self.config.images, insecure) as client:
            ref, manifest, plat = await self._resolve(client, refs)
            image_config, layers = await self._image_config(client, ref, manifest)
            emit({"type": "resolved", "image": str(ref), "digest": manifest.digest,
                  "platform": plat, "layers": [{"digest": lay.digest, "size": lay.size}
                                               for lay in layers]})
            started = time.monotonic()
            source = f"{ref.registry}/{ref.repository}@{manifest.digest}"
            top_first = [*reversed([lay.layer_id for lay in layers]), ROOT_LAYER]
            # Held until the template is registered and the eviction pass is over: the
            # layers of the image being pulled are never the ones evicted for it.
            with self.cache.held(top_first):
                await self._download(client, ref, layers, source, insecure, emit)
                cfg = image_config.get("config") or {}
                # Reads the image's /etc/passwd: off the loop. The store is written on the loop.
                user = await asyncio.to_thread(_default_user, str(cfg.get("User") or ""),
                                               [self.layout.layer(i) for i in top_first],
                                               template_name)
                tpl = self._template(template_name, source, top_first, cfg, user)
                await self.cache.evict()
        log.info("pulled %s (%s, %d layers) in %.1fs as template %s", ref, manifest.digest,
                 len(layers), time.monotonic() - started, tpl.template_id)
        return tpl

    async def _image_config(self, client: RegistryClient, ref: ImageRef, manifest: Manifest
                            ) -> tuple[dict[str, Any], list[_Layer]]:
        """The image config of a platform manifest, and its layers bottom first."""
        body = manifest.json()
        config_desc = body.get("config") or {}
        config_digest = str(config_desc.get("digest", ""))
        check_digest(config_digest)
        image_config = _json_object(await client.blob_bytes(ref, config_digest), "image config")
        arch = image_config.get("architecture")
        if arch and arch != host_platform()[1]:
            # A single-platform image for another CPU would only fail at exec time.
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"{ref} is built for {image_config.get('os', 'linux')}/{arch}, "
                            f"this host runs {'/'.join(host_platform())}")
        return image_config, _layers(body, image_config)

    async def _download(self, client: RegistryClient, ref: ImageRef, layers: list[_Layer],
                        source: str, insecure: bool, emit: ProgressSink) -> None:
        await asyncio.to_thread(self.layout.layers_dir.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(ensure_root_layer, self.layout.layers_dir)
        tasks = [asyncio.create_task(self._layer(client, ref, lay, source, insecure, emit))
                 for lay in layers]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # ---------------------------------------------------------------- the layer cache
    def _source_of(self, layer: str) -> tuple[str, bool] | None:
        """Where an evicted layer can be fetched again: the image recorded with it in the
        cache, else any pulled template that stacks it."""
        entry = self.cache.entry(layer)
        if entry is not None and entry.source:
            return entry.source, entry.insecure
        for tpl in self.store.iter_templates():
            if tpl.source_image and layer in tpl.layers:
                return tpl.source_image, False
        return None

    async def ensure_layers(self, layers: list[str]) -> None:
        """Make every cached (OCI) layer of a layer stack local again, fetching evicted ones
        from the image they came from (by manifest digest: exactly the same bytes). Counts
        cache hits and misses. The caller holds the layers (so no eviction takes them)."""
        wanted = [layer for layer in layers if is_cached_layer(layer)]
        if not wanted:
            return
        with self.cache.held(wanted):
            missing = [layer for layer in wanted
                       if not await asyncio.to_thread(layer_present, self.layout.layer(layer))]
            self.cache.hits += len(wanted) - len(missing)
            self.cache.misses += len(missing)
            by_source: dict[tuple[str, bool], set[str]] = {}
            for layer in missing:
                origin = self._source_of(layer)
                if origin is None:
                    raise AenvError(ErrorCode.NOT_FOUND,
                                    f"layer {layer} is not on this node and no image records "
                                    "where it came from; pull the image again")
                by_source.setdefault(origin, set()).add(layer)
            for (source, insecure), ids in by_source.items():
                started = time.monotonic()
                await self.fetch_layers(source, insecure, ids)
                log.info("layer cache: fetched %d evicted layers of %s again in %.1fs",
                         len(ids), source, time.monotonic() - started)
            self.cache.touch(wanted)
            if missing:
                await self.cache.evict()

    async def collect_layers(self) -> None:
        """An eviction pass (the manager calls it when sandboxes or templates go away)."""
        await self.cache.evict()

    async def fetch_layers(self, source: str, insecure: bool, layer_ids: set[str],
                           progress: ProgressSink | None = None) -> None:
        """Download and unpack the layers `layer_ids` of the image `source`
        (registry/repository@sha256:<platform manifest digest>)."""
        ref = parse_reference(source)
        async with RegistryClient(self.config.images, insecure) as client:
            client.check_allowed(ref)
            manifest = await client.manifest(ref, ref.digest)
            if manifest.media_type in INDEX_TYPES:
                raise AenvError(ErrorCode.INVALID_ARGUMENT,
                                f"{source} is an image index, not the platform manifest")
            _, layers = await self._image_config(client, ref, manifest)
            chosen = [lay for lay in layers if lay.layer_id in layer_ids]
            absent = layer_ids - {lay.layer_id for lay in chosen}
            if absent:
                raise AenvError(ErrorCode.NOT_FOUND,
                                f"{source} has no layer {', '.join(sorted(absent))}")
            await self._download(client, ref, chosen, source, insecure,
                                 progress or (lambda _: None))

    # ---------------------------------------------------------------- resolve
    async def _resolve(self, client: RegistryClient, refs: list[ImageRef]
                       ) -> tuple[ImageRef, Manifest, str]:
        """The first candidate that exists, its platform manifest, and that platform."""
        tried: list[str] = []
        last: AenvError | None = None
        for ref in refs:
            try:
                client.check_allowed(ref)
                manifest = await client.manifest(ref)
            except AenvError as exc:
                # A short name moves on to the next search registry when this one does not
                # have it (or may not be used); any other failure is the answer.
                if len(refs) > 1 and exc.code in (ErrorCode.NOT_FOUND, ErrorCode.INVALID_ARGUMENT,
                                                  ErrorCode.UNAUTHENTICATED):
                    tried.append(f"{ref}: {exc.message}")
                    last = exc
                    continue
                raise
            plat = "/".join(host_platform())
            if manifest.media_type in INDEX_TYPES:
                digest, plat = _choose_platform(manifest)
                manifest = await client.manifest(ref, digest)
                if manifest.media_type in INDEX_TYPES:
                    raise AenvError(ErrorCode.NOT_SUPPORTED, f"{ref}: nested image indexes")
            return ref, manifest, plat
        assert last is not None
        raise AenvError(last.code, "image not found in any search registry: " + "; ".join(tried))

    def _check_name(self, name: str) -> None:
        if not name or len(name) > 256 or any(c.isspace() for c in name):
            raise invalid(f"invalid template name {name!r}")
        current = self.store.find_template(name)
        if current is not None and (current.source_image is None or current.image is not None):
            raise AenvError(ErrorCode.CONFLICT,
                            f"'{name}' is already a template that was not pulled from an image "
                            "(base or a snapshot); pick another --name")

    # ---------------------------------------------------------------- layers
    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _layer(self, client: RegistryClient, ref: ImageRef, lay: _Layer, source: str,
                     insecure: bool, emit: ProgressSink) -> None:
        total = lay.size or 0
        final = self.layout.layer(lay.layer_id)

        def event(state: str, done: int) -> None:
            emit({"type": "layer", "digest": lay.digest, "state": state, "total": total,
                  "done": done})

        event("waiting", 0)
        async with self._lock(lay.layer_id):
            if await asyncio.to_thread(layer_present, final):
                size = -1 if lay.layer_id in self.cache else await asyncio.to_thread(
                    tree_bytes, final)
                self.cache.add(lay.layer_id, size, source, insecure)
                event("exists", total)
                return
            if (self.lazy is not None and self.config.images.on_demand
                    and await self.lazy.available(lay.layer_id)):
                event("lazy", 0)
                size = await self.lazy.attach(lay.layer_id, final)
                self.cache.add(lay.layer_id, 0, source, insecure, lazy=True)
                log.info("layer %s attached on demand (%d bytes of files, none fetched yet)",
                         lay.layer_id, size)
                event("done", total)
                return
            if await asyncio.to_thread(final.is_symlink):
                # An on-demand layer whose FUSE mount is gone: unpack it for real instead.
                await asyncio.to_thread(final.unlink)
            blob = self.blobs_dir / lay.digest.replace(":", "-")
            await asyncio.to_thread(self.blobs_dir.mkdir, parents=True, exist_ok=True)
            try:
                async with self._downloads:
                    event("downloading", 0)
                    last = [0.0]

                    def downloaded(done: int) -> None:
                        now = time.monotonic()
                        if now - last[0] >= 0.2:  # events at most 5/s per layer
                            last[0] = now
                            event("downloading", done)

                    await client.download(ref, lay.digest, lay.size, blob, downloaded)
                event("verifying", total)
                async with self._unpacks:
                    loop = asyncio.get_running_loop()

                    def unpacked(done: int) -> None:
                        loop.call_soon_threadsafe(event, "extracting", done)

                    event("extracting", 0)
                    await _to_thread_to_the_end(layerfs.unpack_layer, blob, lay.media_type,
                                                lay.diff_id, self.layout.layers_dir, unpacked)
                self.cache.add(lay.layer_id, await asyncio.to_thread(tree_bytes, final), source,
                               insecure)
                if self.lazy is not None and self.config.images.convert_layers:
                    self._convert_later(lay.layer_id)
            finally:
                # The compressed blob is not kept once unpacked (or found bad): the layer
                # directory is the only copy. A `.partial` stays for a later resume.
                await asyncio.to_thread(blob.unlink, True)
        event("done", total)

    def _convert_later(self, layer: str) -> None:
        """Push an unpacked layer to the repository in the background (held meanwhile: the
        push reads the directory, so the cache must not evict it)."""
        assert self.lazy is not None
        lazy = self.lazy
        self.cache.hold([layer])

        async def run() -> None:
            try:
                await lazy.convert(layer, self.layout.layer(layer))
            except AenvError as exc:
                log.warning("could not convert layer %s for on-demand pulls: %s", layer,
                            exc.message)
            finally:
                self.cache.release([layer])

        task = asyncio.create_task(run(), name=f"aenv-convert-{layer}")
        self._conversions.add(task)
        task.add_done_callback(self._conversions.discard)

    # ---------------------------------------------------------------- the template
    def _template(self, name: str, source: str, top_first: list[str], cfg: dict[str, Any],
                  user: str) -> TemplateRecord:
        env: dict[str, str] = {}
        for item in cfg.get("Env") or []:
            key, sep, value = str(item).partition("=")
            if sep and key:
                env[key] = value
        s = self.config.sandbox
        current = self.store.find_template(name)
        template_id = current.template_id if current is not None else "img-" + secrets.token_hex(6)
        tpl = TemplateRecord(
            template_id=template_id, names=[name], layers=top_first, cpu_count=s.cpu_count,
            memory_mb=s.memory_mb, disk_size_mb=s.disk_size_mb, default_user=user,
            default_workdir=str(cfg.get("WorkingDir") or "") or None, env_vars=env,
            created_at=datetime.now(UTC), source_image=source)
        self.store.put_template(tpl)
        return tpl


async def _to_thread_to_the_end(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn` in a thread; a cancellation (another layer of the pull failed) waits for the
    thread to finish before it propagates: a thread cannot be stopped midway, and returning
    early would leave its temporary directory behind a pull that reports failure."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await future
        raise


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AenvError(ErrorCode.INVALID_ARGUMENT, f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise AenvError(ErrorCode.INVALID_ARGUMENT, f"{what} is not a JSON object")
    return value


def _choose_platform(index: Manifest) -> tuple[str, str]:
    """The host's platform (linux/amd64 here) from an image index: (digest, "os/arch")."""
    want_os, want_arch = host_platform()
    seen: list[str] = []
    for entry in index.json().get("manifests") or []:
        plat = entry.get("platform") or {}
        label = f"{plat.get('os', '?')}/{plat.get('architecture', '?')}"
        if plat.get("variant"):
            label += "/" + str(plat["variant"])
        seen.append(label)
        if plat.get("os") == want_os and plat.get("architecture") == want_arch:
            return str(entry.get("digest", "")), f"{want_os}/{want_arch}"
    raise AenvError(ErrorCode.NOT_FOUND,
                    f"the image has no {want_os}/{want_arch} variant (it has: "
                    f"{', '.join(s for s in seen if s != 'unknown/unknown') or 'none'})")


def _layers(manifest: dict[str, Any], image_config: dict[str, Any]) -> list[_Layer]:
    """The manifest's layers (bottom first) paired with the config's diff_ids."""
    descs = manifest.get("layers") or []
    diff_ids = (image_config.get("rootfs") or {}).get("diff_ids") or []
    if len(descs) != len(diff_ids):
        raise AenvError(ErrorCode.INVALID_ARGUMENT,
                        f"the manifest lists {len(descs)} layers, the image config "
                        f"{len(diff_ids)} diff_ids")
    out = []
    for desc, diff_id in zip(descs, diff_ids, strict=True):
        digest = str(desc.get("digest", ""))
        check_digest(digest)
        size = desc.get("size")
        out.append(_Layer(digest, int(size) if isinstance(size, int) else None,
                          str(desc.get("mediaType", "")), str(diff_id)))
    for lay in out:
        layerfs.compression_of(lay.media_type)  # refuse unsupported types before any download
        layerfs.layer_id(lay.diff_id)
    return out


def _read_passwd(layers_top_first: list[Path]) -> list[list[str]] | None:
    """/etc/passwd of the merged image (the top-most layer that has or deletes it)."""
    for layer in layers_top_first:
        path = layer / "etc/passwd"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None  # a whiteout, or a symlink we do not follow outside a sandbox
        text = path.read_text(errors="replace")
        return [line.split(":") for line in text.splitlines() if line.count(":") >= 6]
    return None


def _default_user(user: str, layers_top_first: list[Path], image: str) -> str:
    """The image's USER as a name envd can look up in /etc/passwd: "root" when unset; a
    uid is mapped to its name; a user the image does not define falls back to root (with a
    log line), because envd refuses to run anything as an unknown user."""
    name = user.split(":", 1)[0]
    if not name or name in ("root", "0"):
        return "root"
    rows = _read_passwd(layers_top_first) or []
    for row in rows:
        if row[0] == name or (name.isdigit() and row[2] == name):
            return row[0]
    log.warning("%s: USER %r is not in the image's /etc/passwd; sandboxes run as root",
                image, user)
    return "root"
