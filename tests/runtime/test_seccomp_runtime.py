"""The seccomp filter (runtime/container/seccomp.py) on container sandboxes at the driver
level: loaded in every sandbox by the fork-server, and kept by CRIU through a pause/resume
and in copies restored from a snapshot, with the same refusals after the restore."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import CreateFn
from sandbox_helpers import run
from test_checkpoint import RestoreFn, forget, freezer, restore_new  # noqa: F401 - fixture

from aenv.runtime.base import RuntimeHandle
from aenv.runtime.container import checkpoint as ck
from aenv.runtime.container.driver import ContainerDriver

# A user namespace of its own (unshare -Ur), the filter's verdicts on keyctl, io_uring_setup
# and clone3 through python's ctypes, and the filter mode of this command, envd and a process
# started before the checkpoint (the sleeper).
PROBE = r"""
unshare -Ur true 2>&1 | grep -q 'Operation not permitted' && echo unshare=EPERM
python3 -c '
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
for name, nr, args in (("keyctl", 250, (1, 0)), ("io_uring_setup", 425, (4, 0)),
                       ("clone3", 435, (0, 0))):
    libc.syscall(nr, *args)
    print(f"{name}={errno.errorcode[ctypes.get_errno()]}")
'
grep Seccomp: /proc/self/status /proc/1/status /proc/$(cat /tmp/sleeper)/status
"""
EXPECTED = {"unshare": "EPERM", "keyctl": "EPERM", "io_uring_setup": "EPERM",
            "clone3": "ENOSYS"}


async def filtered(driver: ContainerDriver, handle: RuntimeHandle) -> None:
    for user in ("root", "user"):
        out = (await run(driver, handle, PROBE, user=user)).stdout
        verdicts = dict(re.findall(r"^([\w-]+)=(\w+)$", out, re.MULTILINE))
        assert verdicts == EXPECTED, (user, out)
        modes = re.findall(r"Seccomp:\s+(\d)", out)
        assert modes == ["2", "2", "2"], (user, out)  # this command, envd (pid 1), sleeper


async def test_every_sandbox_is_filtered_and_stays_so_after_pause_and_resume(
        driver: ContainerDriver, create: CreateFn, rootfs: Path, tmp_path: Path) -> None:
    handle = await create()
    await run(driver, handle, "nohup sleep 600 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
    await filtered(driver, handle)
    sid = handle.sandbox_id
    await ck.dump(handle.data["pid"], tmp_path / "img", freezer=freezer(sid),
                  leave_running=False)
    forget(driver, sid)
    res = await ck.restore(tmp_path / "img", workspace=Path(handle.data["workspace"]),
                           lower=[driver.driver_layer, rootfs],
                           cgroup_dirs=ck.cgroup_dirs(driver.cgroups, sid))
    handle.data |= {"pid": res.pid, "start_time": res.start_time}
    await filtered(driver, handle)


async def test_copies_restored_from_a_snapshot_are_filtered(
        driver: ContainerDriver, create: CreateFn, restore_new: RestoreFn,  # noqa: F811
        tmp_path: Path) -> None:
    src = await create()
    await run(driver, src, "nohup sleep 600 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
    ws = Path(src.data["workspace"])
    await ck.dump(src.data["pid"], tmp_path / "img", freezer=freezer(src.sandbox_id),
                  leave_running=True, upper=ws / "upper")
    await filtered(driver, src)  # the dump suspended the filter for its parasite only
    for lazy in (False, True):
        await filtered(driver, await restore_new(tmp_path / "img", lazy=lazy))
