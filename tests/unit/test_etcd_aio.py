"""The swarm's asyncio etcd client (agents/sim/etcd_aio.py) on the session etcd.

What the benchmark's figures rest on: the registry's transactions and compare-and-puts
answer as through the agent's blocking client, every call is counted under the
agent's names, keep-alives report an expired lease, and watches set up together on
one stream (their creations pipelined) each get their own events and no other's.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Awaitable, Callable

import pytest

from elastic_rt.etcd_server import EtcdServer
from agents.sim.etcd_aio import AioEtcdKV
from elastic_rt.rendezvous.kv import Change, PutIf
from elastic_rt.rendezvous.registry import RunRequests
from elastic_rt.rendezvous.rounds import NodeInfo

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(30)]


def run(scenario: Callable[[AioEtcdKV], Awaitable[None]], endpoint: str) -> None:
    """``scenario`` on a fresh client, within 20 s."""
    async def main() -> None:
        kv = AioEtcdKV(endpoint)
        try:
            await asyncio.wait_for(scenario(kv), 20)
        finally:
            await kv.close()

    asyncio.run(main())


def test_join_and_compare_and_put_answer_as_the_registry_expects(etcd_server: EtcdServer) -> None:
    requests = RunRequests(f"aio-{uuid.uuid4().hex[:8]}")

    async def scenario(kv: AioEtcdKV) -> None:
        lease = await kv.grant_lease(10)
        first = requests.joined(await kv.txn(requests.join_request(
            NodeInfo(node_id="a", host="h", nproc=1), lease)))
        second = requests.joined(await kv.txn(requests.join_request(
            NodeInfo(node_id="b", host="h", nproc=1), lease)))
        assert first.leader and not second.leader
        assert "nodes/a" in first.items and "nodes/a" not in second.items  # a follower's read
        key = requests.key("round")
        token = await kv.put_if(PutIf(key, b"r0", {key: 0}))
        assert token is not None and token > second.revision
        assert await kv.put_if(PutIf(key, b"r1", {key: 0})) is None  # the compare failed
        held = await kv.get(key)
        assert held is not None and (held.value, held.mod_revision) == (b"r0", token)
        assert [item.key for item in await kv.get_prefix(requests.key("nodes/"))] == [
            requests.key("nodes/a"), requests.key("nodes/b")]
        await kv.revoke_lease(lease)
        await kv.revoke_lease(lease)  # already gone: not an error, as for EtcdKV
        assert kv.counter.snapshot() == {"grant_lease": 1, "txn": 2, "put_if": 2, "get": 1,
                                         "get_prefix": 1, "revoke_lease": 2}

    run(scenario, etcd_server.endpoint)


def test_keep_alives_report_an_expired_lease(etcd_server: EtcdServer) -> None:
    async def scenario(kv: AioEtcdKV) -> None:
        alive, gone = await kv.grant_lease(10), await kv.grant_lease(10)
        await kv.revoke_lease(gone)
        assert await kv.refresh_leases([alive, gone]) == [True, False]
        assert kv.counter.snapshot()["refresh_lease"] == 2  # one per lease, as etcd counts

    run(scenario, etcd_server.endpoint)


def test_watches_set_up_together_on_one_stream_each_get_their_own_events(
        etcd_server: EtcdServer) -> None:
    prefix = f"/aio-{uuid.uuid4().hex[:8]}/"

    async def scenario(kv: AioEtcdKV) -> None:
        seen: dict[int, list[list[Change] | None]] = {i: [] for i in range(20)}
        cancels = await asyncio.gather(*(
            kv.watch_changes(f"{prefix}{i}/", seen[i].append, start_revision=0)
            for i in range(20)))
        for i in range(20):
            await kv.put_if(PutIf(f"{prefix}{i}/k", str(i).encode(), {}))
        while any(not events for events in seen.values()):
            await asyncio.sleep(0.01)
        for i, events in seen.items():
            keys = [(c.kv.key, c.kv.value, c.deleted) for batch in events if batch for c in batch]
            assert keys == [(f"{prefix}{i}/k", str(i).encode(), False)], (i, keys)
        cancels[0]()
        await kv.put_if(PutIf(f"{prefix}0/k", b"again", {}))
        await kv.put_if(PutIf(f"{prefix}1/k", b"again", {}))
        while len(seen[1]) < 2:
            await asyncio.sleep(0.01)
        assert len(seen[0]) == 1  # cancelled: heard nothing more
        assert kv.counter.snapshot()["watch"] == 20

    run(scenario, etcd_server.endpoint)
