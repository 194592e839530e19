"""Named crash points: fault injection for the crash-consistency tests (`tests/faults/`).

`AENV_CRASH_AT=<op>:<step>[,<op>:<step>...]` in a server's environment makes it kill itself
with SIGKILL (exactly what `kill -9` does: no cleanup, no flush, no `finally`) when it reaches
that point of that operation. The points are listed in `CRASH_POINTS`, each where a real crash
would leave something half-done; the tests stop the server at every one of them, restart it
and check that recovery converged (docs/reliability.md).

Owns: the list of points and the act of crashing. Must not touch: anything else; a server
without the variable pays one dictionary lookup per point reached.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

log = logging.getLogger("aenv.faults")

ENV = "AENV_CRASH_AT"

CRASH_POINTS = (
    # create (and create from a snapshot, and each fork child): the intent is on disk
    "create:intent",  # the record says creating, nothing made yet
    "create:made",  # the driver made the sandbox, the record still says creating
    # pause
    "pause:intent",  # the record says pausing, the checkpoint not started
    "pause:criu",  # while criu dumps the sandbox (the server dies under it)
    "pause:dumped",  # the image is complete, the record still says pausing
    # resume
    "resume:intent",
    "resume:criu",  # while criu restores it
    "resume:restored",  # running again, the record still says resuming
    # snapshot (and the capture of a fork)
    "snapshot:criu",  # while criu dumps it: the sandbox is frozen
    "snapshot:dumped",  # image and sealed layer made, no template record
    "snapshot:recorded",  # the template is recorded, its push not started
    # fork
    "fork:captured",  # the fork's transient template recorded, no child yet
    "fork:children",  # the children run and are recorded, the fork not committed
    # background pushes of snapshots to the repository
    "push:layers",  # the snapshot's sealed layers pushed, its image not
    "repository:chunks",  # a push's chunks uploaded, its manifest not written
)


def _armed(name: str) -> bool:
    wanted = os.environ.get(ENV)
    return wanted is not None and name in wanted.split(",")


def _crash(name: str) -> None:
    log.critical("crash point %s reached: killing the server (%s)", name, ENV)
    for handler in logging.getLogger().handlers:  # the test reads the log to know it got here
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def crash_point(name: str) -> None:
    """Die here, as `kill -9` would, if `AENV_CRASH_AT` names this point."""
    assert name in CRASH_POINTS, name
    if _armed(name):
        _crash(name)


def crash_soon(name: str, delay_s: float = 0.002) -> asyncio.TimerHandle | None:
    """Die `delay_s` from now if `AENV_CRASH_AT` names this point: for a point in the middle
    of a helper's run (criu), which the server only waits for. Returns the timer (cancel it
    when the helper is done) or None."""
    assert name in CRASH_POINTS, name
    if not _armed(name):
        return None
    return asyncio.get_running_loop().call_later(delay_s, _crash, name)
