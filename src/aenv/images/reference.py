"""Image references: parsing, normalising, and expanding short names.

Owns: the grammar of `[registry/]repository[:tag][@sha256:digest]` and the rules that turn
a short name (`alpine`, `python:3.12`) into fully qualified candidates through the configured
search registries (Docker Hub style registries get the `library/` prefix).
Must not touch: the network, the disk, the record store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aenv.errors import invalid

DOCKER_HUB = "docker.io"
# The host that actually answers the distribution API for docker.io references.
_API_HOSTS = {DOCKER_HUB: "registry-1.docker.io", "index.docker.io": "registry-1.docker.io"}
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImageRef:
    registry: str  # host[:port], as written (docker.io for Docker Hub)
    repository: str  # path inside the registry, e.g. library/alpine
    tag: str | None = "latest"
    digest: str | None = None  # sha256:<hex> when pinned

    @property
    def api_host(self) -> str:
        return _API_HOSTS.get(self.registry, self.registry)

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def _looks_like_registry(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost"


def parse_reference(text: str, default_registry: str = DOCKER_HUB) -> ImageRef:
    """Parse one reference; a name without a registry part gets `default_registry`."""
    raw = text.strip()
    if not raw or any(c.isspace() for c in raw):
        raise invalid(f"invalid image reference {text!r}")
    name, digest = raw, None
    if "@" in raw:
        name, digest = raw.split("@", 1)
        if not _DIGEST.match(digest):
            raise invalid(f"invalid image reference {text!r}: digest must be sha256:<64 hex>")
    tag: str | None = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:  # a colon after the last slash is a tag, not a registry port
        name, tag = name[:colon], name[colon + 1:]
        if not _TAG.match(tag):
            raise invalid(f"invalid image reference {text!r}: bad tag {tag!r}")
    parts = name.split("/")
    if len(parts) > 1 and _looks_like_registry(parts[0]):
        registry, path = parts[0], parts[1:]
    else:
        registry, path = default_registry, parts
    if registry == "index.docker.io":
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and len(path) == 1:
        path = ["library", *path]
    if not path or not all(_COMPONENT.match(p) for p in path):
        raise invalid(f"invalid image reference {text!r}: repository names are lowercase "
                      "[a-z0-9] components separated by '/', '.', '_' or '-'")
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry=registry, repository="/".join(path), tag=tag, digest=digest)


def is_qualified(text: str) -> bool:
    """Whether `text` names its registry explicitly."""
    first = text.split("@", 1)[0].split("/", 1)
    return len(first) > 1 and _looks_like_registry(first[0])


def candidates(text: str, search_registries: list[str]) -> list[ImageRef]:
    """The references to try, in order: the reference itself when it names a registry,
    else one per search registry."""
    if is_qualified(text):
        return [parse_reference(text)]
    registries = search_registries or [DOCKER_HUB]
    return [parse_reference(text, default_registry=r) for r in registries]


def normalise(text: str, search_registries: list[str]) -> str:
    """The canonical form of a reference (first candidate), used as a template name."""
    return str(candidates(text, search_registries)[0])
