"""One server, both runtimes: a sandbox's runtime is chosen at create time (SDK metadata
`aenv.runtime`), the other driver starts on first use, and each sandbox reports its own."""

from __future__ import annotations

import os
import platform

import httpx
import pytest
from e2b import Sandbox

from aenv.devserver import ServerProcess


@pytest.mark.slow
def test_container_and_microvm_side_by_side(server: ServerProcess, api: httpx.Client) -> None:
    default = os.environ.get("AENV_TEST_RUNTIME", "container")
    other = "qemu" if default == "container" else "container"
    made = []
    try:
        for runtime in (default, other):
            s = Sandbox.create(metadata={"aenv.runtime": runtime}, timeout=300)
            made.append(s)
            assert api.get(f"/sandboxes/{s.sandbox_id}").json()["runtime"] == runtime
        kernels = {s.sandbox_id: s.commands.run("uname -r").stdout.strip() for s in made}
        by_runtime = dict(zip((default, other), kernels.values(), strict=True))
        assert by_runtime["container"] == platform.release()  # the host's kernel
        assert by_runtime["qemu"] != platform.release()  # the guest's own
        for s in made:  # the same API on both: files, pause, resume
            s.files.write("/tmp/kept", s.sandbox_id)
            assert s.pause() is True
            again = Sandbox.connect(s.sandbox_id)
            assert again.files.read("/tmp/kept") == s.sandbox_id
    finally:
        for s in made:
            s.kill()
