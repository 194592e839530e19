"""Build a runtime driver by its configured name (`runtime.driver`).

Owns: the mapping from driver names to implementations. Concrete drivers are imported only
when chosen, so the orchestrator never depends on one.
Must not touch: driver internals; it only constructs.
"""

from __future__ import annotations

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import RuntimeDriver

DRIVERS = ("container", "firecracker", "qemu")


def load_driver(name: str, config: Config) -> RuntimeDriver:
    """A new, not yet started driver. Unknown names raise AenvError(INVALID_ARGUMENT)."""
    if name == "container":
        from aenv.runtime.container.driver import ContainerDriver

        return ContainerDriver(config)
    if name == "qemu":
        from aenv.runtime.qemu.driver import QemuDriver

        return QemuDriver(config)
    if name == "firecracker":
        from aenv.runtime.firecracker.driver import FirecrackerDriver

        return FirecrackerDriver(config)
    raise AenvError(ErrorCode.INVALID_ARGUMENT,
                    f"unknown runtime driver {name!r} (available: {', '.join(DRIVERS)})")
