"""Peer copies of pipeline stages and tensor-parallel parts in host memory.

A part (a ``(pp, tp)`` cut of the model) with no replica on another node is lost with its
node. Like the FSDP family (``sharded/peer_copies``, whose sending and receiving this
reuses), every ``every`` steps each rank snapshots its own part by name (local tensors, how
each is cut, and the :class:`TrainMeta` of that step) and sends a copy to its holder on
another node (``copy_placement``: the same local rank on the next node when nodes are equal;
on nodes of unequal sizes a small node's ranks hold several copies), in the background on a
side group. A copy counts once it has arrived whole; the two newest of each part are kept.
A restore then finds each lost part in its holder's copy (``copy_sources``) and moves it by
name like a live part (``by_name.fetch_offers``): at most ``every`` steps are done again,
and nothing is read from storage unless a part and its copy are lost together.

Memory per rank: four parts' worth of host memory on equal nodes (two snapshots of its own
part, two of the copy it holds), as under FSDP (``sharded/peer_copies``); two more per
extra copy a rank holds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from elastic_rt.errors import ConfigError
from elastic_rt.process_groups import group_timeout, side_group
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker import abort
from elastic_rt.worker.context import Context
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.checkpoint_restore import named_state
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Part
from elastic_rt.worker.trainers.runtime_parallel.by_name import Offer, flatten, offer_of
from elastic_rt.worker.trainers.copy_placement import copy_holders, gather_nodes, held_for
from elastic_rt.worker.trainers.runtime_parallel.copy_sources import Copy, needs_copies
from elastic_rt.worker.trainers.runtime_parallel.sharding import piece_of
from elastic_rt.worker.trainers.runtime_step import initialize_optimizer_state
from elastic_rt.worker.trainers.sharded.peer_copies import PeerCopies, Ring, Snapshot

logger = logging.getLogger(__name__)


def named_part(state: TrainState) -> tuple[dict[str, Any], bool]:
    """The state by name, flat, and whether its optimizer has taken no step yet.

    torch's ``get_state_dict`` fills an empty optimizer with a real step at lr 0, which
    counts in Adam's bias correction: the state would no longer train like the reference.
    Here an empty optimizer's tensors are made without hooks (``initialize_optimizer_state``)
    and dropped again; the flag tells a restore to drop them too.
    """
    is_fresh = initialize_optimizer_state(state.optimizer)
    flat = flatten(named_state(state))
    if is_fresh:
        state.optimizer.state.clear()
    return flat, is_fresh


def _piece(state: TrainState, cut: Part, part: Part) -> dict[str, Any]:
    """What a snapshot holds: the part by name, as local tensors and how each is cut."""
    flat, is_fresh = named_part(state)
    offer = offer_of(flat)
    return {"cut": cut, "part": part, "described": offer.described, "tensors": offer.tensors,
            "is_fresh": is_fresh}


class PartCopies:
    """This rank's snapshots of its part and of the copies it holds, across rounds.

    Used from the training thread only. The snapshots of the round before the last restore
    stay until the restore that reads them has moved them (:meth:`clear`).
    """

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ConfigError(f"peer_copy_every={every} is negative",
                              "Pass 0 (no peer copies) or a number of steps >= 1.")
        self.every = every
        self.round: PeerCopies | None = None  # this round's copies
        self.snapshots: list[Snapshot] = []  # own and held ones, once the copies stopped
        self._committed: int | None = None  # the step whose copies all landed last

    def start(self, ctx: Context) -> None:
        """This round's placement, where one node's loss could take a part (collective)."""
        if not self.every:
            return
        nodes = gather_nodes(ctx.node_id, ctx.groups.world)  # nodes may differ in size
        holders = copy_holders(nodes)
        if holders is None or not needs_copies(ctx.layout, nodes):
            if holders is None and needs_copies(ctx.layout, nodes) and ctx.rank == 0:
                logger.warning("every rank is on node %s: parts without a replica come back "
                               "from the checkpoint", nodes[0])
            return
        group = side_group(ctx.groups.world, group_timeout(ctx.groups.dp))
        assert group is not None  # the round's groups exist
        sources = held_for(ctx.rank, holders)
        (pieces, width), (opp, otp) = piece_of(ctx.layout, ctx.rank)
        indices = []
        for source in sources:
            _, (spp, stp) = piece_of(ctx.layout, source)
            indices.append(spp * width + stp)
        ring = Ring(to=holders[ctx.rank], sources=sources, count=pieces * width,
                    own_index=opp * width + otp, peer_indices=tuple(indices))
        self.round = PeerCopies(group, ring, every=self.every)
        self._committed = None

    def settle(self) -> None:
        """Wait for the send in flight, before a step changes the state, so that the
        :meth:`refresh` after it never waits.

        Raises:
            RoundAbandoned: the round's notice came while the previous send was in flight.
        """
        if self.round is not None:
            self.round.settle()

    def refresh(self, ctx: Context, committed: int, state: TrainState,
                sampler: ElasticSampler, *, force: bool = False) -> None:
        """Snapshot the part at ``committed`` (``sampler`` as it is after that step) and send
        it to its holder, when due (or ``force``, unless that step was sent already).

        Called at the end of a step, once its optimizer has stepped: a copy then leaves as
        soon as the rank is done, and lands while the slower stages still finish theirs. Call
        :meth:`settle` before the step: this never waits then (a wait could fail a step
        whose update is applied).
        """
        copies = self.round
        if copies is None or not (force or copies.is_due(committed)):
            return
        meta = TrainMeta.capture(step=committed, sampler=sampler, state=state)
        copies.refresh(committed, _piece(state, *piece_of(ctx.layout, ctx.rank)),
                       meta.encode())

    def commit(self, ctx: Context, step: int) -> None:
        """On a step whose copies were due: wait until every rank's copy of ``step`` has
        landed on its holder, then for every rank to know it (one small all-reduce over the
        world). Collective; nothing without copies.

        So a step counts as done only once no single node's loss can take a part of it: a
        node lost at any moment after a step then costs no step done again (with copies every
        step), where copies landing beside the next step cost one whenever the node died
        before its copy was out. The price is the copy's transfer on the step's path, on
        the steps that send one (``peer_copy_every``).

        Raises:
            RoundAbandoned: the round's notice came first.
            RuntimeError: a peer is gone.
        """
        copies = self.round
        if copies is None or (self._committed is not None
                              and step - self._committed < self.every):
            return  # decided from the steps alone: every rank of the round agrees
        copies.settle()
        copies.wait_landed(step)
        everyone = torch.zeros(1)
        work = dist.all_reduce(everyone, group=ctx.groups.world, async_op=True)
        assert work is not None  # async_op=True always returns a Work
        abort.wait(work.get_future())
        self._committed = step

    def stop(self) -> None:
        """End this round's copies; keep the snapshots and the copies that arrived."""
        if self.round is not None:
            self.snapshots = self.round.close()
            self.round = None

    def clear(self) -> None:
        """Drop the snapshots (the state is cut anew; they are taken again)."""
        self.snapshots = []

    def held(self) -> list[Copy]:
        """The parts of the snapshots and copies held, for the choice of sources."""
        return [Copy(s.step, s.piece["cut"], s.piece["part"]) for s in self.snapshots]

    def offer(self, step: int, part: Part) -> tuple[Offer, dict[str, Any], bool]:
        """The snapshot of ``part`` at ``step`` to send from, its record, and whether its
        optimizer had taken no step (:func:`named_part`)."""
        for snapshot in self.snapshots:
            piece = snapshot.piece
            if snapshot.step == step and piece["part"] == part:
                return Offer(piece["described"], piece["tensors"]), snapshot.meta, piece["is_fresh"]
        raise LookupError(f"no snapshot of part {part} at step {step}")  # chosen from held()

    def host_bytes(self) -> int:
        """Host memory this round's copies take (0 without copies)."""
        return 0 if self.round is None else self.round.host_bytes()
