"""One proposer per run, and the run as a node sees it from watched changes alone.

A join costs a follower three etcd calls (lease, transaction, watch) and a round costs
it none; the leader writes each round once (1024 nodes form a round in 0.6-0.9 s
against one local etcd, ``scripts/bench/rendezvous.py``). Every node reading the
whole run would cost O(N) calls per node and O(N^2) bytes per round. The first node
to register takes the ``round-leader`` key on its own lease, in the same transaction
that registers it (:meth:`RunRegistry.join`). The leader watches the whole run, so it
sees registrations and losses, and alone proposes rounds; followers watch only the
``round`` prefix (the round, the leader key and the job's state: alarm, completing,
in-process, closed) and read nothing after joining.

Fencing: a round is written with a compare on the previous
round's revision, so a stale leader (its lease just ended) cannot overwrite a newer
round, and ranks come from :func:`rounds.next_members`. When the leader's
lease ends its key goes with it; the followers see the deletion and each tries one
claim transaction, which exactly one wins; the winner reads the whole run in that
same transaction and watches from there.

:class:`RunView` is the pure part: the keys as read at a revision plus every
change since, turned into the :class:`~elastic_rt.rendezvous.rounds.Snapshot`
that :func:`rounds.decide` takes.
"""

from __future__ import annotations

from elastic_rt.rendezvous.kv import Change, KeyValue
from elastic_rt.rendezvous.registry import LEADER, ROUND, Joined, node_from, snapshot_from
from elastic_rt.rendezvous.rounds import NodeInfo, Snapshot

_NODES = "nodes/"


class RunView:
    """The run's keys as of ``joined`` and every change applied since.

    Args:
        prefix: the run's key prefix (``/elastic_rt/<run_id>/``).
        joined: what the join or claim transaction read.
    """

    def __init__(self, prefix: str, joined: Joined) -> None:
        self.prefix = prefix
        self.leader = joined.leader
        self.revision = joined.revision
        self._items: dict[str, KeyValue] = {}
        self._nodes: dict[str, NodeInfo] = {}
        """Registrations, decoded once as they arrive (the leader sees N of them)."""
        self._snapshot: Snapshot | None = None
        self._deleted: dict[str, int] = {}
        """Revision each key was last deleted at, so an older read cannot revive it."""
        for item in joined.items.values():
            self._set(item.key[len(prefix):], item)

    @property
    def watch_prefix(self) -> str:
        """What this node must watch: the whole run as leader, the round prefix if not."""
        return self.prefix if self.leader else self.prefix + "round"

    @property
    def leader_gone(self) -> bool:
        return LEADER not in self._items

    @property
    def leader_revision(self) -> int:
        """The leader key's revision as held (0: none); the holder's re-read compares it."""
        item = self._items.get(LEADER)
        return item.mod_revision if item else 0

    @property
    def round_token(self) -> int:
        """The held round's revision (0: none yet), read without decoding the round."""
        item = self._items.get(ROUND)
        return item.mod_revision if item else 0

    def apply(self, changes: list[Change]) -> None:
        """Apply watched changes; one older than what is held is ignored."""
        for change in changes:
            name = change.kv.key[len(self.prefix):]
            held = self._items.get(name)
            newest = max(held.mod_revision if held else 0, self._deleted.get(name, 0))
            if change.kv.mod_revision <= newest:
                continue
            if change.deleted:
                self._items.pop(name, None)
                self._nodes.pop(name[len(_NODES):], None)
                self._deleted[name] = change.kv.mod_revision
            else:
                self._set(name, change.kv)
            self.revision = max(self.revision, change.kv.mod_revision)
            self._snapshot = None

    def _set(self, name: str, item: KeyValue) -> None:
        self._items[name] = item
        if name.startswith(_NODES):
            self._nodes[name[len(_NODES):]] = node_from(item)

    def merge(self, joined: Joined) -> None:
        """Take newer values from a claim that lost (its reads are of the followed keys)."""
        self.apply([Change(kv, deleted=False) for kv in joined.items.values()])

    def snapshot(self) -> Snapshot:
        """The run as of the last change (decoded once per change, not per call)."""
        if self._snapshot is None:
            self._snapshot = snapshot_from(self._items, nodes_known=self.leader,
                                           nodes=dict(self._nodes))
        return self._snapshot
