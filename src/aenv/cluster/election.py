"""Leader election on etcd: the leader is whoever holds `key`, created under its lease.

`run()` campaigns forever: a replica creates the key if it is absent (a transaction on its
create revision), keeps its lease alive every ttl/3, and is leader while that works. If the
leader dies its lease runs out and the key goes with it: another replica creates it within
`ttl_s` + one check interval. A replica that finds its own lease expired (partitioned away
for longer than the TTL) stops calling itself leader before it campaigns again.

Owns: the one key it campaigns for. Must not touch: anything else in etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aenv.cluster.etcd import Etcd
from aenv.errors import AenvError

log = logging.getLogger("aenv.cluster")


class Election:
    def __init__(self, etcd: Etcd, key: str, value: bytes, ttl_s: int = 3) -> None:
        self.etcd = etcd
        self.key = key
        self.value = value
        self.ttl_s = ttl_s
        self.lease = 0
        self.is_leader = False

    async def run(self) -> None:
        interval = max(self.ttl_s / 3, 0.2)
        while True:
            try:
                await self._step()
            except AenvError as exc:
                if self.is_leader:
                    log.warning("election %s: lost contact with etcd (%s)", self.key,
                                exc.message)
                self.is_leader = False
            await asyncio.sleep(interval)

    async def _step(self) -> None:
        if self.lease and await self.etcd.keepalive(self.lease) <= 0:
            if self.is_leader:
                log.warning("election %s: our lease expired; no longer leader", self.key)
            self.lease = 0
            self.is_leader = False
        if not self.lease:
            self.lease = await self.etcd.grant(self.ttl_s)
        if self.is_leader:
            return
        if await self.etcd.create(self.key, self.value, lease=self.lease):
            self.is_leader = True
            log.info("election %s: elected", self.key)
            return
        current = await self.etcd.get(self.key)
        if current is not None and current.lease == self.lease:
            self.is_leader = True  # ours already (a retried create whose answer was lost)

    async def resign(self) -> None:
        self.is_leader = False
        if self.lease:
            with contextlib.suppress(AenvError):
                await self.etcd.revoke(self.lease)
            self.lease = 0
