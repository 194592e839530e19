"""The etcd client (aenv.cluster.etcd) and the election (aenv.cluster.election) against a real
etcd: keys, prefixes, compare-and-swap, leases that expire, and a leader that dies."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from conftest import EtcdServer

from aenv.cluster.election import Election
from aenv.cluster.etcd import Etcd, encode, prefix_end
from aenv.errors import AenvError


@pytest.fixture
async def client(etcd: EtcdServer) -> Etcd:
    return Etcd(etcd.url)


@pytest.fixture
def prefix() -> str:
    return f"/t/{uuid.uuid4().hex[:8]}/"


def test_prefix_end() -> None:
    assert prefix_end("/aenv/") == b"/aenv0"
    assert prefix_end("ab") == b"ac"


async def test_put_get_prefix_delete(client: Etcd, prefix: str) -> None:
    assert await client.get(prefix + "a") is None
    rev = await client.put(prefix + "a", b"1")
    await client.put(prefix + "b", encode({"x": 1}))
    await client.put(prefix[:-1] + "c", b"outside")  # shares the prefix but for the slash
    kv = await client.get(prefix + "a")
    assert kv is not None and kv.value == b"1" and kv.mod_revision == rev
    listed = await client.get_prefix(prefix)
    assert [k.key for k in listed] == [prefix + "a", prefix + "b"]
    assert listed[1].json() == {"x": 1}
    assert await client.delete(prefix + "a") == 1
    assert await client.delete(prefix + "a") == 0
    assert await client.delete_prefix(prefix) == 1
    assert await client.get_prefix(prefix) == []
    await client.close()


async def test_compare_and_swap(client: Etcd, prefix: str) -> None:
    key = prefix + "k"
    assert await client.create(key, b"first")
    assert not await client.create(key, b"second")
    kv = await client.get(key)
    assert kv is not None and kv.value == b"first"
    assert await client.replace(key, b"third", kv.mod_revision)
    assert not await client.replace(key, b"stale", kv.mod_revision)  # revision moved on
    assert not await client.delete_if(key, kv.mod_revision)
    now = await client.get(key)
    assert now is not None and now.value == b"third"
    assert await client.delete_if(key, now.mod_revision)
    assert await client.get(key) is None
    await client.close()


async def test_lease_expiry_removes_keys(client: Etcd, prefix: str) -> None:
    lease = await client.grant(2)
    await client.put(prefix + "leased", b"x", lease=lease)
    assert await client.keepalive(lease) > 0
    kv = await client.get(prefix + "leased")
    assert kv is not None and kv.lease == lease
    deadline = time.monotonic() + 10
    while await client.get(prefix + "leased") is not None:
        assert time.monotonic() < deadline, "the lease never expired"
        await asyncio.sleep(0.2)
    assert await client.keepalive(lease) == 0  # expired: a holder knows it must re-register
    await client.revoke(lease)  # revoking an expired lease is not an error
    await client.close()


async def test_unreachable_endpoint_fails_over_and_reports() -> None:
    dead = Etcd("http://127.0.0.1:9")
    with pytest.raises(AenvError) as err:
        await dead.get("/x")
    assert "unreachable" in err.value.message
    await dead.close()


async def test_second_endpoint_is_used(etcd: EtcdServer, prefix: str) -> None:
    both = Etcd(f"http://127.0.0.1:9,{etcd.url}")
    await both.put(prefix + "k", b"v")
    kv = await both.get(prefix + "k")
    assert kv is not None and kv.value == b"v"
    await both.close()


async def test_election_one_leader_and_takeover(etcd: EtcdServer, prefix: str) -> None:
    key = prefix + "leader"
    a, b = Etcd(etcd.url), Etcd(etcd.url)
    ea, eb = Election(a, key, b"a", ttl_s=2), Election(b, key, b"b", ttl_s=2)
    ta, tb = asyncio.create_task(ea.run()), asyncio.create_task(eb.run())
    try:
        deadline = time.monotonic() + 5
        while not (ea.is_leader or eb.is_leader):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # several rounds: still exactly one
        assert ea.is_leader != eb.is_leader
        leader, follower, task = (ea, eb, ta) if ea.is_leader else (eb, ea, tb)
        kv = await a.get(key)
        assert kv is not None and kv.value == leader.value
        task.cancel()  # the leader dies without resigning: its lease must run out
        t0 = time.monotonic()
        while not follower.is_leader:
            assert time.monotonic() - t0 < 8, "no takeover"
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        assert 0.5 < took < 5, took  # not before the dead leader's lease expired
        kv = await a.get(key)
        assert kv is not None and kv.value == follower.value
    finally:
        ta.cancel()
        tb.cancel()
        await asyncio.gather(ta, tb, return_exceptions=True)
        await ea.resign()
        await eb.resign()
        await a.close()
        await b.close()
