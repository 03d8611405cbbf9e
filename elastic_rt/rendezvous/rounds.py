"""Round formation as pure decisions over a snapshot of the store.

A *round* is one agreed membership: the member nodes in group-rank order and the
fencing token (the etcd revision that wrote it). Every agent reads a
:class:`Snapshot`, calls :func:`decide`, and acts on the answer; when the answer is
:class:`Propose`, it writes the round with a compare on the previous round's
revision, so exactly one proposer wins and the others re-read.

Nothing here sleeps, reads a clock or touches etcd: time comes in as ``now`` and
the last-call start as ``quorum_since``, which makes every rule a unit test.

Rules:
- The first round forms when ``max_nodes`` are registered, or when ``min_nodes``
  have been registered for ``last_call`` seconds.
- A round whose member is gone is replaced at once by the survivors plus any
  waiting nodes (up to ``max_nodes``). If fewer than ``min_nodes`` remain, that
  round is a *paused* one: it has fewer than ``min_nodes`` members, so nobody runs
  workers in it, and it is replaced as soon as ``min_nodes`` are there again. It is
  written rather than left to each node to infer because only the leader sees the
  registrations: the round is how followers learn to stop their workers.
- Waiting nodes are taken in at once while the round has fewer than ``max_nodes``.
- Survivors keep their relative order, so their ranks move as little as possible.
- A node that does not see the registrations (``Snapshot.nodes_known`` false: a
  follower of the run's leader, see :mod:`elastic_rt.rendezvous.election`) never
  proposes: it takes part in the current round if listed, else waits. Only the
  leader, which watches the registrations, decides on losses and admissions; so a
  round costs one write, not a race of every node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from elastic_rt.errors import StoreStateError


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A registered node, as stored under ``nodes/<node_id>`` on its lease."""

    node_id: str
    host: str
    nproc: int
    alive_addr: str = ""
    """``host:port`` of the agent's liveness socket; refused means the agent is dead."""
    joined_revision: int = 0
    """The key's create revision: the order in which nodes arrived."""
    lease: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {"node_id": self.node_id, "host": self.host, "nproc": self.nproc,
             "alive_addr": self.alive_addr}
        ).encode()  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes, *, joined_revision: int = 0, lease: int = 0) -> "NodeInfo":
        data = _loads(raw, "node record")
        return cls(
            node_id=str(data["node_id"]),
            host=str(data["host"]),
            nproc=int(data["nproc"]),
            alive_addr=str(data.get("alive_addr", "")),
            joined_revision=joined_revision,
            lease=lease,
        )


@dataclass(frozen=True, slots=True)
class Round:
    """One agreed membership. ``members[i]`` has group rank ``i``."""

    number: int
    members: tuple[str, ...]
    nprocs: tuple[int, ...]
    hosts: tuple[str, ...]
    reason: str = ""
    created_ms: int = 0
    restarts: int = 0
    """Worker failures the job had counted when this round formed: its workers'
    ``TORCHELASTIC_RESTART_COUNT``. Set by the round that restarts the job after a
    failure (:func:`restart_round`); every other round carries its predecessor's, so a
    membership change keeps it, as torchrun's count ignores nodes joining or leaving.

    Note: a node stepping out to replace a failed in-process worker leaves the
    survivors to re-form without it, in a round that carries the count from before;
    workers that recover in place read their environment once, at start."""
    token: int = 0
    """mod_revision of the round key as read; not stored in the value itself."""

    @property
    def world_size(self) -> int:
        return sum(self.nprocs)

    def group_rank(self, node_id: str) -> int:
        return self.members.index(node_id)

    def rank_offset(self, node_id: str) -> int:
        """Global rank of the node's first worker."""
        return sum(self.nprocs[: self.group_rank(node_id)])

    def node_of_rank(self, rank: int) -> str:
        """The member whose workers hold global ``rank``.

        Raises:
            ValueError: no rank of the round is ``rank``.
        """
        end = 0
        for member, count in zip(self.members, self.nprocs):
            end += count
            if rank < end:
                return member
        raise ValueError(f"round {self.number} has no rank {rank}")

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "number": self.number,
                "members": list(self.members),
                "nprocs": list(self.nprocs),
                "hosts": list(self.hosts),
                "reason": self.reason,
                "created_ms": self.created_ms,
                "restarts": self.restarts,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, token: int = 0) -> "Round":
        data = _loads(raw, "round record")
        return cls(
            number=int(data["number"]),
            members=tuple(data["members"]),
            nprocs=tuple(int(n) for n in data["nprocs"]),
            hosts=tuple(data["hosts"]),
            reason=str(data.get("reason", "")),
            created_ms=int(data.get("created_ms", 0)),
            restarts=int(data.get("restarts", 0)),
            token=token,
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the store held at one moment."""

    round: Round | None
    nodes: Mapping[str, NodeInfo]
    closed: str | None = None
    """Why the job was closed (finished or failed); None while it runs."""
    completing: bool = False
    """Some node's workers all succeeded: the job is finishing, so no new rounds."""
    alarm: tuple[int, int] | None = None
    """(round, revision) of the last worker alarm: a collective failed in that round."""
    in_process: bool = False
    """The run's workers recover in place (an agent saw them say so)."""
    nodes_known: bool = True
    """False for a follower, whose view holds no registrations: ``nodes`` is empty."""
    trained_round: int | None = None
    """The newest round in which the ranks completed a step (rank 0's ``progress`` key); -1
    before the first; None where not known (a follower's view), which holds back nothing."""


@dataclass(frozen=True, slots=True)
class Participate:
    """Run (or keep running) this round's workers."""

    round: Round


@dataclass(frozen=True, slots=True)
class Propose:
    """Write ``round`` if the round key still has revision ``expected_token``."""

    round: Round
    expected_token: int


SPARE = "round is full; waiting as a spare"
"""Why a registered node beyond ``max_nodes`` waits: it takes the place of the next member
lost, in the round that drops that member."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do yet; ``quorum_since`` is the caller's new last-call start."""

    reason: str
    quorum_since: float | None = None
    stop_workers: bool = False
    """True when this node's current round is broken and its workers must stop."""


@dataclass(frozen=True, slots=True)
class Closed:
    reason: str


Action = Participate | Propose | Wait | Closed


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    min_nodes: int
    max_nodes: int
    last_call: float = 1.0
    """Seconds to wait for more nodes once ``min_nodes`` are there."""


def decide(
    snapshot: Snapshot,
    me: str,
    limits: Limits,
    *,
    now: float,
    quorum_since: float | None,
    now_ms: int = 0,
) -> Action:
    """What node ``me`` should do given ``snapshot``. Pure."""
    if snapshot.closed is not None:
        return Closed(snapshot.closed)
    current = snapshot.round
    if snapshot.completing:
        if current is not None and me in current.members:
            return Participate(current)
        return Closed("the job is finishing")
    if not snapshot.nodes_known:
        return _follow(current, me, limits)
    if current is None:
        return _first_round(snapshot, limits, now=now, quorum_since=quorum_since, now_ms=now_ms)

    alive = snapshot.nodes
    lost = [m for m in current.members if m not in alive]
    waiting = _waiting(snapshot)
    i_am_member = me in current.members
    paused = is_paused(current, limits)
    if not paused and not lost and (not waiting or len(current.members) >= limits.max_nodes):
        if i_am_member:
            return Participate(current)
        return Wait(SPARE)
    if not paused and not lost and not trained_in(snapshot, current):
        # An admission waits until the current round has trained a step. A round that only
        # adds ranks does not cut the members' waits short (worker/abort.py), so a newer one
        # formed while this one's ranks are still joining split them: a rank starting late
        # joined the newest round while the others waited for it in this one's rendezvous
        # (a soak stalled 24 s so, until a leave timeout dropped a node).
        if i_am_member:
            return Participate(current)
        return Wait(f"waiting for round {current.number} to train before admitting more nodes")
    members = next_members(current, snapshot.nodes, limits.max_nodes)
    short = f"{len(members)} of at least {limits.min_nodes} nodes left"
    if len(members) < limits.min_nodes:
        if paused:
            return Wait(f"paused: {short}", stop_workers=i_am_member)
        return Propose(_make_round(current.number + 1, members, snapshot.nodes,
                                   f"paused: {short}", now_ms, restarts=current.restarts),
                       expected_token=current.token)
    admitting = ",".join(n.node_id for n in waiting)
    reason = f"lost {','.join(lost)}" if lost else f"admitting {admitting}"
    if paused:
        reason = f"resumed with {len(members)} nodes"
    # In a job that recovers in place the members keep the ranks they train with: a
    # member whose workers are being replaced asks for its ranks back once they are
    # ready (agents' ``running._grow_back``); giving them back here would make the
    # round wait for their import. A paused round's workers stopped: all start anew.
    keeping = current if snapshot.in_process and not paused else None
    return Propose(
        _make_round(current.number + 1, members, snapshot.nodes, reason, now_ms,
                    restarts=current.restarts, ranks_from=keeping),
        expected_token=current.token,
    )


def trained_in(snapshot: Snapshot, round_: Round) -> bool:
    """Whether ``round_``'s ranks have completed a step (or it need not be known: workers
    restarted every round, or a view without the run's progress)."""
    return (not snapshot.in_process or snapshot.trained_round is None
            or snapshot.trained_round >= round_.number)


def is_paused(round_: Round, limits: Limits) -> bool:
    """A round with fewer than ``min_nodes`` members: the job waits for more nodes."""
    return len(round_.members) < limits.min_nodes


def _follow(current: Round | None, me: str, limits: Limits) -> Action:
    """A follower's whole rule: the leader forms rounds, the follower takes its place."""
    if current is None:
        return Wait("waiting for the leader to form the first round")
    if is_paused(current, limits):
        return Wait(f"paused: {len(current.members)} of at least {limits.min_nodes} nodes",
                    stop_workers=me in current.members)
    if me in current.members:
        return Participate(current)
    if len(current.members) >= limits.max_nodes:
        return Wait(SPARE)
    return Wait("waiting for the leader to admit this node")


def _first_round(
    snapshot: Snapshot, limits: Limits, *, now: float, quorum_since: float | None, now_ms: int
) -> Action:
    count = len(snapshot.nodes)
    if count < limits.min_nodes:
        return Wait(f"{count} of at least {limits.min_nodes} nodes registered")
    members = next_members(None, snapshot.nodes, limits.max_nodes)
    if count >= limits.max_nodes:
        return Propose(_make_round(0, members, snapshot.nodes, "all nodes joined", now_ms), 0)
    since = now if quorum_since is None else quorum_since
    if now - since >= limits.last_call:
        return Propose(_make_round(0, members, snapshot.nodes, "last call ended", now_ms), 0)
    return Wait(f"{count} nodes registered; last call for more", quorum_since=since)


def _waiting(snapshot: Snapshot) -> list[NodeInfo]:
    members = set(snapshot.round.members) if snapshot.round else set()
    return sorted(
        (n for n in snapshot.nodes.values() if n.node_id not in members),
        key=lambda n: (n.joined_revision, n.node_id),
    )


def next_members(
    current: Round | None, nodes: Mapping[str, NodeInfo], max_nodes: int
) -> tuple[str, ...]:
    """Survivors in their old order, then newcomers in arrival order, up to ``max_nodes``."""
    survivors = [m for m in current.members if m in nodes] if current else []
    taken = set(survivors)
    newcomers = sorted(
        (n for n in nodes.values() if n.node_id not in taken),
        key=lambda n: (n.joined_revision, n.node_id),
    )
    return tuple((survivors + [n.node_id for n in newcomers])[:max_nodes])


def _make_round(
    number: int, members: tuple[str, ...], nodes: Mapping[str, NodeInfo], reason: str, now_ms: int,
    *, restarts: int = 0, ranks_from: Round | None = None
) -> Round:
    """``ranks_from``: a round whose members keep the ranks they have in it; the others
    (newcomers, or every member without it) contribute the ranks they registered."""
    kept = dict(zip(ranks_from.members, ranks_from.nprocs)) if ranks_from else {}
    return Round(
        number=number,
        members=members,
        nprocs=tuple(kept.get(m, nodes[m].nproc) for m in members),
        hosts=tuple(nodes[m].host for m in members),
        reason=reason,
        created_ms=now_ms,
        restarts=restarts,
    )


def restart_round(current: Round, reason: str, now_ms: int, *, restarts: int | None = None
                  ) -> Propose:
    """The same members in a new round: how a worker failure restarts every node.

    ``restarts``: the job's failure count after the one that restarts it; None keeps
    ``current``'s (a re-form or a rejoin restarts workers without a failure counted).
    """
    return Propose(
        Round(
            number=current.number + 1,
            members=current.members,
            nprocs=current.nprocs,
            hosts=current.hosts,
            reason=reason,
            created_ms=now_ms,
            restarts=current.restarts if restarts is None else restarts,
        ),
        expected_token=current.token,
    )


def without(current: Round, node_id: str, reason: str, now_ms: int, limits: Limits) -> Propose:
    """The round after ``current`` once ``node_id`` leaves it at a step boundary: the
    others in their order, so their ranks move as little as for a loss. Below
    ``min_nodes`` it is a paused round, as the leader would write after a loss."""
    members = tuple(m for m in current.members if m != node_id)
    kept = [i for i, m in enumerate(current.members) if m != node_id]
    if len(members) < limits.min_nodes:
        reason = f"paused: {len(members)} of at least {limits.min_nodes} nodes left ({reason})"
    return Propose(
        Round(number=current.number + 1, members=members,
              nprocs=tuple(current.nprocs[i] for i in kept),
              hosts=tuple(current.hosts[i] for i in kept), reason=reason, created_ms=now_ms,
              restarts=current.restarts),
        expected_token=current.token,
    )  # fmt: skip


def _loads(raw: bytes, what: str) -> dict:  # type: ignore[type-arg]
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreStateError(f"the {what} in etcd is not JSON: {raw[:80]!r}") from exc
    if not isinstance(data, dict):
        raise StoreStateError(f"the {what} in etcd is not a JSON object: {raw[:80]!r}")
    return data
