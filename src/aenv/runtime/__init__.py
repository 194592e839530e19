"""The runtime driver interface: how the orchestrator asks an isolation technology for sandboxes.

A driver owns the processes, namespaces/VMs, cgroups and mounts of its sandboxes. It does not
know about HTTP, the E2B API, TTLs or the record store (that is the orchestrator's job).
Drivers plug in like httpx transports: the orchestrator holds a `RuntimeDriver` and never
imports a concrete driver; `aenv.runtime.registry.load_driver(name, ...)` builds one by name.
"""

from aenv.runtime.base import (
    ResourceUsage,
    RuntimeDriver,
    RuntimeHandle,
    SandboxSpec,
)

__all__ = ["ResourceUsage", "RuntimeDriver", "RuntimeHandle", "SandboxSpec"]
