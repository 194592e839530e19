"""The bounded local cache of unpacked OCI layers (`layers/oci-sha256-*`).

Owns: the cache index `cache/oci-layers.json` (per layer: bytes on disk, last use, and the
image it came from, so that an evicted layer can be fetched again), the cache counters
(hits, misses, evictions) and removing cold layers. Must not touch: any other layer (`base`,
`seal-*`, the shared image root layer), sandbox records or templates: which layers live
sandboxes and operations hold is asked through the `in_use` callback (the manager's answer).

Rules (docs/operations.md, "Image layer cache"):
- eviction runs after every pull or re-fetch and whenever the manager collects layers (a
  sandbox killed, a template deleted, server start); it removes least recently used layers
  while the total is above `images.cache_bytes` (0: unbounded);
- never a layer in `in_use()` (layers of running, paused and transitional sandboxes, of
  creates in flight and of the default template, which the ready pool may use) nor one
  held here (a pull downloading or registering it);
- the choice and the rename out of `layers/` happen on the event loop without an `await` in
  between, so a create that holds a layer either finds it in place or fetches it again;
  the renamed tree is deleted in a thread afterwards.
The cache may stay above its limit when everything in it is in use: pulls and creates never
fail because of the limit (`over_limit` in the stats says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aenv.images.layers import LAYER_PREFIX
from aenv.images.lazy import LazyLayers, remove_tree

log = logging.getLogger("aenv.images")

_EVICTING_PREFIX = ".evicting-"
TOUCH_SAVE_INTERVAL_S = 5.0
MAX_EVICTED_KEPT = 10_000  # sources of evicted layers remembered (for fetching them again)


def is_cached_layer(layer: str) -> bool:
    """Whether the cache manages this layer id (unpacked OCI layers only)."""
    return layer.startswith(LAYER_PREFIX) and "/" not in layer


def layer_present(path: Path) -> bool:
    """Whether a layer directory is usable (an on-demand layer's symlink into a dead FUSE
    mount answers ENOTCONN, which `Path.is_dir` raises)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def tree_bytes(path: Path) -> int:
    """Bytes a layer directory takes on disk (allocated blocks; hard links counted once)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_nlink > 1 and not os.path.isdir(os.path.join(dirpath, name)):
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += st.st_blocks * 512
    return total


@dataclass
class LayerEntry:
    size: int  # bytes on disk
    last_used: float  # unix time of the last pull or sandbox create that used it
    source: str | None = None  # registry/repository@sha256:<manifest digest>
    insecure: bool = False  # the pull that brought it used plain HTTP
    lazy: bool = False  # served on demand (lazy.py): size is what was fetched so far


@dataclass
class LayerCacheStats:
    max_bytes: int
    bytes: int
    layers: int
    held: int  # layers in use (live sandboxes, operations in flight)
    hits: int  # layers found local when a sandbox was created
    misses: int  # layers fetched again for a create (they had been evicted)
    evictions: int
    evicted_bytes: int
    over_limit: bool

    def to_json(self) -> dict[str, Any]:
        return {"maxBytes": self.max_bytes, "bytes": self.bytes, "layers": self.layers,
                "held": self.held, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "evictedBytes": self.evicted_bytes,
                "overLimit": self.over_limit}


class LayerCache:
    """One node's cache of unpacked OCI layers. Methods run on the event loop except
    `load` (blocking, at server start) and the deletions it starts in threads."""

    def __init__(self, layers_dir: Path, index: Path, max_bytes: int,
                 in_use: Callable[[], set[str]] | None = None,
                 lazy: LazyLayers | None = None) -> None:
        self.layers_dir = layers_dir
        self.lazy = lazy
        self.index = index
        self.max_bytes = max(0, int(max_bytes))
        self._in_use: Callable[[], set[str]] = in_use or (lambda: set())
        self._entries: dict[str, LayerEntry] = {}
        # Evicted layers: where they came from, to fetch them again (bounded, oldest dropped).
        self._evicted: dict[str, LayerEntry] = {}
        self._held: dict[str, int] = {}
        self._deleting: set[asyncio.Task[None]] = set()
        self._dirty = False
        self._saved_at = 0.0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.evicted_bytes = 0

    # ---------------------------------------------------------------- index
    def load(self) -> None:
        """Blocking: read the index and reconcile it with the disk (layers unpacked before
        the index existed are added with their mtime as last use; half-deleted ones go)."""
        raw: dict[str, Any] = {}
        evicted: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError, ValueError):
            loaded = json.loads(self.index.read_text())
            if isinstance(loaded, dict):
                raw = loaded.get("layers") or {}
                evicted = loaded.get("evicted") or {}
        self._entries = {}
        self._evicted = {}
        for layer, item in evicted.items():
            with contextlib.suppress(TypeError):
                self._evicted[layer] = LayerEntry(**item)
        if self.layers_dir.is_dir():
            for path in self.layers_dir.iterdir():
                if path.name.startswith(_EVICTING_PREFIX):
                    remove_tree(path)
                    continue
                if not is_cached_layer(path.name):
                    continue
                if not layer_present(path):
                    if path.is_symlink():  # a lazy layer whose state is gone
                        path.unlink()
                    continue
                item = raw.get(path.name)
                try:
                    entry = LayerEntry(**item) if isinstance(item, dict) else None
                except TypeError:
                    entry = None
                if entry is None and path.is_symlink():
                    entry = LayerEntry(size=0, last_used=time.time(), lazy=True)
                elif entry is None:
                    entry = LayerEntry(size=tree_bytes(path), last_used=path.stat().st_mtime)
                self._entries[path.name] = entry
                self._evicted.pop(path.name, None)
        self._save()

    def _save(self) -> None:
        # Small and written on the loop like the record store; a lost write only costs
        # precision (load() rebuilds sizes from the disk).
        self.index.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.index.with_name(f".{self.index.name}.{secrets.token_hex(4)}")
        while len(self._evicted) > MAX_EVICTED_KEPT:
            self._evicted.pop(next(iter(self._evicted)))
        self._dirty = False
        self._saved_at = time.time()
        tmp.write_text(json.dumps({"layers": {k: asdict(v) for k, v in self._entries.items()},
                                   "evicted": {k: asdict(v) for k, v in self._evicted.items()}}))
        os.replace(tmp, self.index)

    # ---------------------------------------------------------------- queries
    def __contains__(self, layer: str) -> bool:
        return layer in self._entries

    def entry(self, layer: str) -> LayerEntry | None:
        """A local layer's entry, or what is remembered of an evicted one (its source)."""
        return self._entries.get(layer) or self._evicted.get(layer)

    def total_bytes(self) -> int:
        self._refresh_lazy()
        return sum(e.size for e in self._entries.values())

    def _refresh_lazy(self) -> None:
        """A lazy layer takes what its FUSE process fetched so far (a few stats)."""
        if self.lazy is None:
            return
        for layer, entry in self._entries.items():
            if entry.lazy:
                entry.size = self.lazy.local_bytes(layer)

    def protected(self) -> set[str]:
        return {*self._held, *(layer.split("/", 1)[0] for layer in self._in_use())}

    def stats(self) -> LayerCacheStats:
        total = self.total_bytes()
        held = self.protected()
        return LayerCacheStats(
            max_bytes=self.max_bytes, bytes=total, layers=len(self._entries),
            held=sum(1 for layer in self._entries if layer in held), hits=self.hits,
            misses=self.misses, evictions=self.evictions, evicted_bytes=self.evicted_bytes,
            over_limit=bool(self.max_bytes) and total > self.max_bytes)

    def listing(self) -> list[dict[str, Any]]:
        held = self.protected()
        rows = [{"layer": layer, "bytes": e.size, "lastUsed": e.last_used, "source": e.source,
                 "inUse": layer in held} for layer, e in self._entries.items()]
        return sorted(rows, key=lambda r: -float(r["lastUsed"]))

    # ---------------------------------------------------------------- updates
    def add(self, layer: str, size: int, source: str | None, insecure: bool,
            lazy: bool = False) -> None:
        """A layer just unpacked, or found unpacked by a pull (size -1: keep the known size;
        the pull's image becomes its source)."""
        old = self._entries.get(layer)
        self._evicted.pop(layer, None)
        if size < 0:
            size = old.size if old is not None else 0
        self._entries[layer] = LayerEntry(
            size=size, last_used=time.time(), source=source or (old.source if old else None),
            insecure=insecure if source else (old.insecure if old else False),
            lazy=lazy or (old.lazy if old is not None else False))
        self._save()

    def touch(self, layers: Iterable[str]) -> None:
        """Mark layers used (a sandbox create). Written to the index at most every few
        seconds (a create must not rewrite a big index each time); other changes save at once."""
        now = time.time()
        for layer in layers:
            entry = self._entries.get(layer)
            if entry is not None:
                entry.last_used = now
                self._dirty = True
        if self._dirty and now - self._saved_at >= TOUCH_SAVE_INTERVAL_S:
            self._save()

    def flush(self) -> None:
        """Write last uses not saved yet (server shutdown)."""
        if self._dirty:
            self._save()

    def hold(self, layers: Iterable[str]) -> None:
        for layer in layers:
            self._held[layer] = self._held.get(layer, 0) + 1

    def release(self, layers: Iterable[str]) -> None:
        for layer in layers:
            left = self._held.get(layer, 0) - 1
            if left > 0:
                self._held[layer] = left
            else:
                self._held.pop(layer, None)

    @contextlib.contextmanager
    def held(self, layers: Iterable[str]) -> Iterator[None]:
        items = list(layers)
        self.hold(items)
        try:
            yield
        finally:
            self.release(items)

    # ---------------------------------------------------------------- eviction
    def choose_victims(self) -> list[str]:
        """Least recently used first, until the total fits, skipping protected layers."""
        if not self.max_bytes:
            return []
        total = self.total_bytes()
        if total <= self.max_bytes:
            return []
        protected = self.protected()
        victims = []
        for layer, entry in sorted(self._entries.items(), key=lambda kv: kv[1].last_used):
            if total <= self.max_bytes:
                break
            if layer in protected:
                continue
            victims.append(layer)
            total -= entry.size
        return victims

    async def evict(self) -> list[str]:
        """Evict cold layers down to the limit; returns the evicted layer ids. The choice and
        the renames happen without yielding to the loop (see the module docstring)."""
        victims = self.choose_victims()
        gone: list[Path] = []
        for layer in victims:
            src = self.layers_dir / layer
            dst = self.layers_dir / f"{_EVICTING_PREFIX}{layer}-{secrets.token_hex(4)}"
            try:
                os.rename(src, dst)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not evict layer %s: %s", layer, exc)
                continue
            else:
                gone.append(dst)
            entry = self._entries.pop(layer)
            if entry.lazy and self.lazy is not None:
                state = self.lazy.detach(layer)
                if state is not None:
                    gone.append(state)
            entry.lazy = False
            self._evicted[layer] = entry
            self.evictions += 1
            self.evicted_bytes += entry.size
        if victims:
            self._save()
            log.info("layer cache: evicted %d layers (%s); %d of %d bytes used", len(victims),
                     ", ".join(v[len(LAYER_PREFIX):][:12] for v in victims), self.total_bytes(),
                     self.max_bytes)
        elif self.max_bytes and self.total_bytes() > self.max_bytes:
            log.warning("layer cache is over its limit (%d > %d bytes) but every layer is in "
                        "use", self.total_bytes(), self.max_bytes)
        for path in gone:
            task = asyncio.create_task(asyncio.to_thread(remove_tree, path))
            self._deleting.add(task)
            task.add_done_callback(self._deleting.discard)
        return victims

    async def drain(self) -> None:
        """Wait for the deletions started by `evict` (tests, shutdown)."""
        if self._deleting:
            await asyncio.gather(*self._deleting, return_exceptions=True)
