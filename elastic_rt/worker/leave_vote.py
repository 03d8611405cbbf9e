"""Which step boundary a leaving node leaves at: one every rank agrees on, by a vote per step.

A node that leaves on notice (its agent took SIGTERM or a preemption notice, see
``agents/policy/leaving.py``) must leave at a boundary that every rank stops at. Its own
workers learn of it from their agent's note (``elastic_rt.acks.leave_note``), at any
moment; a rank elsewhere that began the next step before hearing of it would wait for
the leaver's part of that step's collectives until the round without it cut them short,
and then do the step again. So every step, every rank adds "my node leaves after this
step" (0 or 1) to a one-element all-reduce (MAX) on the round's world group, issued as the
step begins and read once it has ended: each rank decides the same thing at the same
boundary, after the same step.

Why it costs nothing to speak of: the vote is issued before the step's own collectives,
and those finish only once every rank has begun the step, so by the time the vote is
read it has long been summed; it is one small message per step beside the gradients
(measured on this 2-core box, 3 gloo ranks, 5-9 ms steps: medians with and without the
vote differ by less than the spread between runs). A gloo tensor on the CPU, so it works
on the CPU side of a mixed NCCL/gloo group too.

Outside ``elastic-rt launch`` there is no agent to leave a note, and a world of one has
nobody to tell: then nothing is sent, and the note alone decides.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from elastic_rt.worker import abort


class LeaveVote:
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
        self._voted = False

    @property
    def is_mine(self) -> bool:
        """This rank's own node is the one that leaves."""
        return self.source is not None

    def begin(self, group: dist.ProcessGroup | None) -> None:
        """As a step begins: look at the note and send this rank's vote (every rank, every
        step, in the same order as the step's collectives: before them)."""
        if self.source is None:
            self.source = self._note()
        self._voted = self.source is not None
        self._work = None
        if group is None or dist.get_world_size(group) < 2:
            return
        self._vote = torch.tensor([1 if self._voted else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=group,
                                     async_op=True)

    def anyone_leaves(self) -> bool:
        """Once the step has ended: whether some rank's node leaves after it.

        Raises:
            RoundAbandoned: a newer round dropped a member while the vote was in flight.
            RuntimeError: the vote's collective failed (a peer is gone).
        """
        work, self._work = self._work, None
        if work is None:
            return self._voted
        abort.wait(work.get_future())
        return bool(self._vote.item())
