"""Which step boundary every rank stops at: one they all agree on, by a vote per step.

Two things make ranks stop training in a round, and both must stop every rank after the
same step, or a rank that began the next step waits for the others' part of its
collectives:

- a node leaving on notice (its agent took SIGTERM or a preemption notice, see
  ``agents/policy/leaving.py``): its own workers learn of it from their agent's note
  (``elastic_rt.acks.leave_note``), at any moment;
- a newer round that only adds ranks (a node admitted, a spare's or a replacement's ranks
  given back): no collective of ours is cut short by it (``worker/abort.py``), and each
  rank's etcd watch sees it at its own moment. Decided alone, at a rank's own boundary,
  that split the members: one sat in the old round's gradient all-reduce while the
  others waited for it in the new round's rendezvous, for the whole collective timeout
  (seen twice in the soak, ``docs/soak.md``).

So every step, every rank adds its flags (``LEAVE``: my node leaves after this step;
``NEWER_ROUND``: I see a newer round; ``SAVING``: my checkpoint save is still being
written) to a one-element all-reduce (bitwise OR) on the
round's world group, issued as the step begins and read once it has ended: each rank
decides the same thing at the same boundary. A newer round is then joined after at most
one more step in the old one.

Why it costs nothing to speak of: the vote is issued before the step's own collectives,
and those finish only once every rank has begun the step, so by the time the vote is
read it has long been summed; it is one small message per step beside the gradients
(measured on this 2-core box, 3 gloo ranks, 5-9 ms steps: medians with and without the
vote differ by less than the spread between runs). A gloo tensor on the CPU, so it works
on the CPU side of a mixed NCCL/gloo group too.

Outside ``elastic-rt launch`` there is no agent to leave a note, and a world of one has
nobody to tell: then nothing is sent, and the rank's own flags decide.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.distributed as dist

from elastic_rt.worker import abort


class Stop(enum.IntFlag):
    """Why the ranks stop at a boundary (none: train on)."""

    NONE = 0
    LEAVE = 1
    """Some rank's node leaves after this step."""
    NEWER_ROUND = 2
    """Some rank sees a newer round: everyone joins it now (unless ``SAVING``)."""
    SAVING = 4
    """Some rank's checkpoint save is still being written: a newer round that only adds
    members waits for it, the members training on in this one (the save's collectives
    run on this round's groups, which the re-form would take from under it: it waited
    for the save, 2.3 s of a 1.2 GB join's pause)."""


class BoundaryVote:
    """One rank's vote, step by step.

    Args:
        note: what asked this rank's node to leave once it has (its agent's note), else
            None; looked at as each step begins until it answers.
    """

    def __init__(self, note: Callable[[], str | None]) -> None:
        self._note = note
        self.source: str | None = None
        """What asked this node to leave, once its note was seen."""
        self._vote = torch.zeros(1, dtype=torch.int32)
        self._work: dist.Work | None = None  # a fresh tensor each step: an abandoned round's
        # vote may still land in its own
        self._mine = Stop.NONE

    @property
    def is_mine(self) -> bool:
        """This rank's own node is the one that leaves."""
        return self.source is not None

    def begin(self, group: dist.ProcessGroup | None, *, newer_round: bool,
              saving: bool = False) -> None:
        """As a step begins: look at the note and send this rank's flags (every rank, every
        step, in the same order as the step's collectives: before them)."""
        if self.source is None:
            self.source = self._note()
        self._mine = ((Stop.LEAVE if self.source is not None else Stop.NONE)
                      | (Stop.NEWER_ROUND if newer_round else Stop.NONE)
                      | (Stop.SAVING if saving else Stop.NONE))
        self._work = None
        if group is None or dist.get_world_size(group) < 2:
            return
        self._vote = torch.tensor([int(self._mine)], dtype=torch.int32)
        self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.BOR, group=group,
                                     async_op=True)

    def outcome(self) -> Stop:
        """Once the step has ended: why every rank stops after it, if any does.

        Raises:
            RoundAbandoned: a newer round dropped a member while the vote was in flight.
            RuntimeError: the vote's collective failed (a peer is gone).
        """
        work, self._work = self._work, None
        if work is None:
            return self._mine
        abort.wait(work.get_future())
        return Stop(int(self._vote.item()))
