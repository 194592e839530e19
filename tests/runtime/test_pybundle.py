"""The runtime bundle: self-contained, small, idempotent to build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime import pybundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the bundle is built from a python 3.11")
    dest = tmp_path_factory.mktemp("bundle") / "py311"
    report = pybundle.build(dest)
    assert not report.errors and report.copied > 100
    yield dest
    shutil.rmtree(dest, ignore_errors=True)


def test_second_build_changes_nothing(bundle: Path) -> None:
    report = pybundle.build(bundle)
    assert report.copied == 0 and report.removed == 0 and report.unchanged > 100


def test_small_and_without_the_dead_weight(bundle: Path) -> None:
    assert pybundle.build(bundle).size_bytes < 80 * 2**20
    stdlib = bundle / "lib/python3.11"
    for gone in ("test", "idlelib", "tkinter", "ensurepip", "lib2to3", "site-packages"):
        assert not (stdlib / gone).exists(), gone
    assert (stdlib / "asyncio/__init__.py").exists()
    assert (stdlib / "__pycache__").is_dir()  # precompiled: the bundle is mounted read-only
    assert (bundle / "app/aenv/envd/server.py").exists()
    assert (bundle / "app/aenv/runtime/container/zygote.py").exists()
    assert not (bundle / "app/aenv/runtime/container/driver.py").exists()  # host-only


def test_runs_from_nothing_but_itself(bundle: Path) -> None:
    code = ("import sys, asyncio, ssl, json, ctypes, hashlib, socket; "
            f"sys.path.insert(0, {str(bundle / 'app')!r}); import aenv.envd.server; "
            "print(sys.prefix); print(open('/proc/self/maps').read())")
    out = subprocess.run([*pybundle.python_argv(bundle), "-c", code], env=pybundle.python_env(),
                         capture_output=True, text=True, check=True, cwd="/").stdout
    prefix, _, maps = out.partition("\n")
    assert prefix == str(bundle)
    files = {line.split()[5] for line in maps.splitlines()
             if len(line.split()) > 5 and line.split()[5].startswith("/")}
    assert files and all(f.startswith(f"{bundle}/") for f in files), files - {
        f for f in files if f.startswith(str(bundle))}


def test_stale_files_are_removed(bundle: Path) -> None:
    stray = bundle / "app/aenv/envd/removed_module.py"
    stray.write_text("x = 1\n")
    # Pretend an earlier build wrote it: it is in the manifest.
    import json

    manifest = json.loads((bundle / pybundle.MANIFEST).read_text())
    manifest["files"]["app/aenv/envd/removed_module.py"] = ["/nowhere", 6, 0]
    (bundle / pybundle.MANIFEST).write_text(json.dumps(manifest))
    report = pybundle.build(bundle)
    assert report.removed == 1 and not stray.exists()
    assert os.access(bundle / "bin/python3.11", os.X_OK)
