"""Typed reads and writes of one run's keys in the store.

Key layout under ``/elastic_rt/<run_id>/``:

====================  ===========================================================
``nodes/<node>``      :class:`NodeInfo` on the node's lease (gone when it dies)
``round``             the current :class:`Round`; its mod_revision is the token
``round-leader``      the node that proposes rounds, on its lease (see election.py)
``round-alarm``       a worker saw a collective fail; agents probe their peers
``round-completing``  some node's workers all succeeded; no more rounds
``round-in-process``  the workers recover in place: a joining node starts its workers
                      before it registers, so admitting it stalls nobody
``round-closed``      why the job ended (finished or failed); agents exit
``store/<k>``         ``host:port`` of round k's c10d store, written by its host
``restarts``          worker failures so far (the job-wide restart budget)
``failure/<k>``       the first worker failure reported in round k
``checkpoint``        name of the last committed checkpoint, written fenced
``max_restarts``      the job's restart budget, written by every agent at start
``max_nodes``         the job's ``--nnodes`` maximum, written with it (nodes beyond are spares)
``layout``            JSON ``{"round", "layout"}`` of the current round, rank 0, fenced
``progress``          JSON ``{"round", "step", "steps_per_s", "ms"}``, rank 0, fenced
``shares``            JSON ``{"round", "step", "nodes", "weights"}``: the batch split unevenly
                      for stragglers (``worker/stragglers.py``), rank 0, fenced
``root_cause``        the last failure's :class:`~elastic_rt.root_cause.RootCause`
``leaving/<node>``    JSON: the node took a preemption notice and leaves at its workers'
                      next step boundary (on its lease; for ``elastic-rt status``)
====================  ===========================================================

Every key a node's decisions read, except the registrations, starts with ``round``:
one watch on that prefix keeps a follower current (election.py), and it never
hears of the N registrations, which only the leader watches.

Two run ids never share a key, so two jobs on one etcd never see each other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

from elastic_rt.errors import FencedOutError, RendezvousTimeoutError, StoreError
from elastic_rt.rendezvous.kv import (
    Delete,
    Get,
    KeyValue,
    KVStore,
    Put,
    PutIf,
    TxnRequest,
    TxnOp,
    TxnResult,
)
from elastic_rt.rendezvous.rounds import NodeInfo, Propose, Round, Snapshot
from elastic_rt.root_cause import RootCause

logger = logging.getLogger(__name__)

ROUND = "round"
LEADER = "round-leader"
ALARM = "round-alarm"
COMPLETING = "round-completing"
IN_PROCESS = "round-in-process"
PROGRESS = "progress"
CLOSED = "round-closed"
LEAVING = "leaving/"
FAILURE_CLAIMS_KEPT = 16
"""Rounds whose failure claims (``failure/<k>``) are kept behind the newest."""
"""Nodes that took a preemption notice (see :meth:`RunRegistry.announce_leaving`)."""
FOLLOWED = ROUND
"""The prefix of the keys a follower's decisions read: everything but the registrations."""


@dataclass(frozen=True, slots=True)
class Joined:
    """What one join (or leadership claim) transaction returned."""

    leader: bool
    """This node holds the leader key now."""
    revision: int
    """The store's revision the reads were taken at: watch from the next one."""
    items: dict[str, KeyValue]
    """Keys by name relative to the run's prefix: the whole run for a leader, else
    the keys under :data:`FOLLOWED`."""


def node_from(item: KeyValue) -> NodeInfo:
    return NodeInfo.from_json(item.value, joined_revision=item.create_revision, lease=item.lease)


_decoded: dict[int, tuple[bytes, Round]] = {}


def decoded_round(value: bytes, token: int) -> Round:
    """The round stored as ``value`` at revision ``token``, decoded once per process.

    An agent holds one node and decodes each new round once, as without the cache.
    The swarm simulator holds hundreds of nodes per process, and each of them gets
    the same round from its own watch: decoding a 1024-member round for every one
    of them cost its process more CPU than etcd needed for the whole round,
    while on real machines each node decodes it once on its own CPU,
    in parallel. ``Round`` is frozen, so the nodes can share the one decoded. Looked
    up by revision, then compared byte for byte (cheaper than hashing the value).
    """
    held = _decoded.get(token)
    if held is not None and held[0] == value:
        return held[1]
    round_ = Round.from_json(value, token=token)
    if len(_decoded) >= 4:
        _decoded.pop(next(iter(_decoded)))
    _decoded[token] = (value, round_)
    return round_


def snapshot_from(items: Mapping[str, KeyValue], *, nodes_known: bool = True,
                  nodes: Mapping[str, NodeInfo] | None = None) -> Snapshot:
    """Decode a run's keys (names relative to its prefix) into a :class:`Snapshot`.

    ``nodes``, when given, are the registrations already decoded (a watcher keeps
    them as they change); else they are decoded from ``items``.
    """
    if nodes is None:
        nodes = {info.node_id: info for info in
                 (node_from(item) for name, item in items.items() if name.startswith("nodes/"))}
    round_kv = items.get(ROUND)
    closed = items.get(CLOSED)
    alarm = items.get(ALARM)
    return Snapshot(
        trained_round=trained_round(items.get(PROGRESS)) if nodes_known else None,
        round=decoded_round(round_kv.value, round_kv.mod_revision) if round_kv else None,
        nodes=nodes,
        closed=closed.value.decode() if closed else None,
        completing=COMPLETING in items,
        in_process=IN_PROCESS in items,
        alarm=(int(json.loads(alarm.value)["round"]), alarm.mod_revision) if alarm else None,
        nodes_known=nodes_known,
    )


def trained_round(progress: KeyValue | None) -> int:
    """The round of the run's last published step (-1: none yet, or a value not understood)."""
    try:
        data = json.loads(progress.value) if progress is not None else None
        return int(data["round"]) if isinstance(data, dict) else -1
    except (ValueError, KeyError, TypeError):
        return -1


def _round_of(key: str, prefix: str) -> int | None:
    """The round number a per-round key names (None for a key of another shape)."""
    try:
        return int(key.removeprefix(prefix))
    except ValueError:
        return None


def store_endpoint(address: str) -> tuple[str, int]:
    """A published ``host:port`` as (host, port); split at the last colon, so an IPv6
    host keeps its own."""
    host, _, port = address.rpartition(":")
    return host, int(port)


class RunRequests:
    """The keys of one run, and the rendezvous's calls on them built as data.

    Each call is built (``*_request``) and its answer read (:meth:`joined`,
    :meth:`proposed`) here, with no client: :class:`RunRegistry` sends them
    blocking (the agent's), agents/sim/run_watch_aio.py on an asyncio client (the swarm
    simulator's), so a thousand simulated nodes send the agent's very transactions.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.prefix = f"/elastic_rt/{run_id}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def join_request(self, info: NodeInfo, lease: int) -> TxnRequest:
        """The transaction of :meth:`RunRegistry.join`."""
        register = Put(self.key(f"nodes/{info.node_id}"), info.to_json(), lease)
        return self._claim_request(info.node_id, lease, (register,))

    def claim_request(self, node_id: str, lease: int, *, held: int = 0) -> TxnRequest:
        """The transaction of :meth:`RunRegistry.claim_leadership`."""
        return self._claim_request(node_id, lease, (), held=held)

    def _claim_request(self, node_id: str, lease: int, writes: tuple[Put, ...], *,
                       held: int = 0) -> TxnRequest:
        leader = self.key(LEADER)
        return TxnRequest(
            {leader: held},
            (Put(leader, node_id.encode(), lease), *writes, Get(self.prefix, prefix=True)),
            (*writes, Get(self.key(FOLLOWED), prefix=True)),
        )

    def joined(self, result: TxnResult) -> Joined:
        """What a join or claim transaction's answer says (names relative to the prefix)."""
        items = {kv.key[len(self.prefix):]: kv for read in result.reads for kv in read}
        return Joined(result.succeeded, result.revision, items)

    def propose_request(self, proposal: Propose) -> PutIf:
        """The compare-and-put of :meth:`RunRegistry.propose`: on the round it saw."""
        return PutIf(self.key(ROUND), proposal.round.to_json(),
                     {self.key(ROUND): proposal.expected_token})

    @staticmethod
    def proposed(proposal: Propose, token: int | None) -> Round | None:
        """The round written at ``token``; None (no token) when another proposer won."""
        if token is None:
            return None
        return dataclasses.replace(proposal.round, token=token)


class RunRegistry(RunRequests):
    """The keys of one run on a :class:`KVStore`."""

    def __init__(self, kv: KVStore, run_id: str) -> None:
        super().__init__(run_id)
        self.kv = kv

    # membership ---------------------------------------------------------------
    def register(self, info: NodeInfo, lease: int) -> None:
        self.kv.put(self.key(f"nodes/{info.node_id}"), info.to_json(), lease=lease)

    def nodes(self) -> dict[str, NodeInfo]:
        nodes = {}
        for item in self.kv.get_prefix(self.key("nodes/")):
            info = NodeInfo.from_json(
                item.value, joined_revision=item.create_revision, lease=item.lease
            )
            nodes[info.node_id] = info
        return nodes

    def node(self, node_id: str) -> NodeInfo | None:
        """One node's registration (one key read), None when it is not registered."""
        item = self.kv.get(self.key(f"nodes/{node_id}"))
        return node_from(item) if item is not None else None

    def evict(self, info: NodeInfo) -> None:
        """Revoke a dead node's lease so its key (and anything else on it) goes now."""
        self.kv.revoke_lease(info.lease)

    def preview(self) -> Snapshot:
        """The run as a node about to join needs it, in one small read.

        The keys under :data:`FOLLOWED`, and whether any node is registered, not the
        registrations themselves (each of N joining nodes reading N of them made a
        job's start O(N^2)): ``nodes_known`` only when none is, and ``nodes`` empty.
        """
        result = self.kv.txn({}, [Get(self.key(FOLLOWED), prefix=True),
                                  Get(self.key("nodes/"), prefix=True, limit=1)])
        followed, anyone = result.reads
        return snapshot_from({kv.key[len(self.prefix):]: kv for kv in followed},
                             nodes_known=not anyone, nodes={})

    def is_registered(self, node_id: str) -> bool:
        return self.kv.get(self.key(f"nodes/{node_id}")) is not None

    def snapshot(self) -> Snapshot:
        # One range read of the whole run: O(nodes) per poll, one round trip.
        return snapshot_from({kv.key[len(self.prefix):]: kv
                              for kv in self.kv.get_prefix(self.prefix)})

    # one transaction to register, claim the leadership if free, and read ----------
    # (built and read by RunRequests, sent here)
    def join(self, info: NodeInfo, lease: int) -> Joined:
        """Register ``info`` on ``lease``; become leader if there is none.

        One round trip: the leader gets the whole run (registrations included), a
        follower only the keys under :data:`FOLLOWED`, as of the same revision.
        """
        return self.joined(self._send(self.join_request(info, lease)))

    def claim_leadership(self, node_id: str, lease: int, *, held: int = 0) -> Joined:
        """Take the leader key if it is free (the leader's lease ended).

        ``held``: the leader key's revision when this node holds it and reads the run
        afresh (its watch broke); the claim then succeeds while the key is still its own.
        """
        return self.joined(self._send(self.claim_request(node_id, lease, held=held)))

    def _send(self, request: TxnRequest) -> TxnResult:
        return self.kv.txn(request.expect, request.success, request.failure)

    def current_round(self) -> Round | None:
        item = self.kv.get(self.key(ROUND))
        return Round.from_json(item.value, token=item.mod_revision) if item else None

    def propose(self, proposal: Propose) -> Round | None:
        """Write the proposed round; None when another proposer won."""
        write = self.propose_request(proposal)
        return self.proposed(proposal, self.kv.put_if(write.key, write.value,
                                                      expect=write.expect))

    # leaving at a step boundary -------------------------------------------------
    def announce_leaving(self, node_id: str, record: dict[str, object], lease: int | None) -> None:
        """Say that ``node_id`` leaves at its workers' next step boundary (for ``status``).

        On the node's lease: the record goes with the node, whether it leaves as planned or
        dies first. No decision reads it (it does not start with :data:`ROUND`).
        """
        self.kv.put(self.key(LEAVING + node_id), json.dumps(record).encode(), lease=lease)

    def leave(self, proposal: Propose, node_id: str) -> Round | None:
        """Write ``proposal`` (the round without ``node_id``) and drop the node's
        registration and leaving record, in one transaction on the round it replaces.

        One transaction, so the leader never sees the node registered outside the round
        (it would admit it again) nor the round still listing a node that is gone (it
        would call it lost). None when the round changed first: read it and try again.
        """
        key = self.key(ROUND)
        result = self.kv.txn(
            {key: proposal.expected_token},
            (Put(key, proposal.round.to_json()), Delete(self.key(f"nodes/{node_id}")),
             Delete(self.key(LEAVING + node_id)), Get(key)),
        )  # fmt: skip
        if not result.succeeded:
            return None
        return dataclasses.replace(proposal.round, token=result.reads[0][0].mod_revision)

    # the round's c10d store ----------------------------------------------------
    def publish_store(self, round_: Round, address: str) -> None:
        """Publish round ``round_``'s store address, and forget older rounds' keys.

        Why here: the host of a new round is the one node sure that every older round is
        replaced, so no one needs their store address any more (a worker still waiting
        for one sees its round gone and stops waiting). Failure claims are kept for
        ``FAILURE_CLAIMS_KEPT`` rounds: a node that reports an older round's failure late
        would otherwise count it against the budget a second time. Without this, one key
        a round stayed for the life of the job (a soak left 268 of them).
        """
        writes: list[TxnOp] = [Put(self.key(f"store/{round_.number}"), address.encode())]
        for name, keep_from in (("store/", round_.number),
                                ("failure/", round_.number - FAILURE_CLAIMS_KEPT)):
            for item in self.kv.get_prefix(self.key(name)):
                number = _round_of(item.key, self.key(name))
                if number is not None and number < keep_from:
                    writes.append(Delete(item.key))
        self.kv.txn({}, writes)

    def store_address(self, round_number: int) -> str | None:
        item = self.kv.get(self.key(f"store/{round_number}"))
        return item.value.decode() if item else None

    def await_store(self, round_number: int, timeout: timedelta, *, gone: Callable[[], bool],
                    sleep: Callable[[float], None], poll: float) -> tuple[str, int] | None:
        """Round ``round_number``'s store (host, port), polled until its host publishes it.

        The agent that agrees on a round and each worker that joins it wait here, so
        both read the address the same way (:func:`store_endpoint`). Returns None as
        soon as ``gone()`` says it never will be published (the round was replaced, or
        its host left first). A read that etcd fails is a poll that found nothing: a
        member of a cluster that restarts fails the call in flight ("leader changed", a
        reset stream) and the next goes to another member. Raised, it ended the agent
        or the worker waiting here (a soak saw both, and the job lose its state).

        Raises:
            RendezvousTimeoutError: neither within ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            try:
                address = self.store_address(round_number)
                if address:
                    return store_endpoint(address)
                if gone():
                    return None
            except StoreError as exc:
                logger.warning("etcd failed a read of round %d's store: %s", round_number, exc)
            sleep(poll)
        raise RendezvousTimeoutError(f"no store address for round {round_number}",
                                     "Check that its first node is alive.")

    # job state -----------------------------------------------------------------
    def restarts(self) -> int:
        item = self.kv.get(self.key("restarts"))
        return int(item.value) if item else 0

    def count_restart(self) -> int:
        """Add one worker failure to the job-wide budget; returns the new count."""
        while True:
            item = self.kv.get(self.key("restarts"))
            count = (int(item.value) if item else 0) + 1
            expect = {self.key("restarts"): item.mod_revision if item else 0}
            if self.kv.put_if(self.key("restarts"), str(count).encode(), expect=expect):
                return count

    def claim_failure(self, round_number: int, what: str) -> bool:
        """True for the first node to report a worker failure in this round.

        A failed worker usually takes its peers' collectives down with it, so
        every node sees a failure; only the first report counts against the budget.
        """
        key = self.key(f"failure/{round_number}")
        return self.kv.put_if(key, what.encode(), expect={key: 0}) is not None

    def raise_alarm(self, round_number: int, reporter: str) -> None:
        payload = {"round": round_number, "reporter": reporter, "ms": int(time.time() * 1000)}
        self.kv.put(self.key(ALARM), json.dumps(payload).encode())

    def mark_in_process(self) -> None:
        self.kv.put(self.key(IN_PROCESS), b"1")

    def mark_completing(self) -> None:
        self.kv.put(self.key(COMPLETING), b"1")

    def close(self, reason: str) -> None:
        self.kv.put_if(self.key(CLOSED), reason.encode(), expect={self.key(CLOSED): 0})

    def closed_reason(self) -> str | None:
        item = self.kv.get(self.key(CLOSED))
        return item.value.decode() if item else None

    def publish_limits(self, *, max_restarts: int, max_nodes: int) -> None:
        """For ``status``: every agent is given the same budget and ``--nnodes``, so any
        may write them (one transaction)."""
        self.kv.txn({}, [Put(self.key("max_restarts"), str(max_restarts).encode()),
                         Put(self.key("max_nodes"), str(max_nodes).encode())])

    def progress(self) -> dict[str, object] | None:
        """The job's last published step (see the ``progress`` key), or None."""
        item = self.kv.get(self.key(PROGRESS))
        try:
            data = json.loads(item.value) if item else None
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def root_cause(self) -> tuple[RootCause | None, int]:
        """The recorded root cause and the key's revision (0: none yet)."""
        item = self.kv.get(self.key("root_cause"))
        if item is None:
            return None, 0
        return RootCause.from_json(item.value), item.mod_revision

    def put_root_cause(self, cause: RootCause, expect_revision: int) -> bool:
        """Write ``cause`` unless the key changed since it was read at ``expect_revision``."""
        key = self.key("root_cause")
        return self.kv.put_if(key, cause.to_json(), expect={key: expect_revision}) is not None

    # fenced commits --------------------------------------------------------------
    def commit_fenced(self, name: str, value: bytes, token: int) -> int:
        """Write ``name`` only while the round written at ``token`` is current.

        Raises:
            FencedOutError: a newer round exists; the writer belongs to an old one.
        """
        revision = self.kv.put_if(self.key(name), value, expect={self.key(ROUND): token})
        if revision is None:
            raise FencedOutError(
                f"commit of {name!r} refused: round token {token} is no longer current"
            )
        return revision
