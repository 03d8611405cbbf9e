"""The replicated family: one ``TrainState`` on every data-parallel rank, stepped by the runtime.

Rule: nothing moves where nothing must, and a join does not stop the job
(``replica_transfer``, ``replica_state``)::

    agree(step, fingerprint)  -> one all-gather of 16 bytes a rank
    every rank holds it       -> nothing moves: "kept", 0 bytes (a node kill)
    some ranks lack it        -> holder 0 broadcasts the small Outline; the receivers take the
                                 position from it; the tensors stream point to point from the
                                 holders, striped, into the receivers' own tensors, while the
                                 holders train the next step on the whole global batch and the
                                 receivers sit it out (no sample); everyone waits for the
                                 stream before the update, and the receivers apply the same
                                 averaged gradients
    nobody holds state        -> the newest committed checkpoint, else rank 0's build (a start)

Built once per worker: survivors keep theirs, and their state is already that of the last
committed step (the runtime's step changes it only after its last collective). A holder's
forward and backward only read what it sends (its buffers, which a forward may write, are
copied first), so the members' pause at a join is the re-form and whatever part of the
transfer outlasts their forward and backward. Memory: nothing beyond the state on either
side, except copies of the model's buffers on a holder and a staging copy per
non-contiguous tensor (``replica_transfer``); a newcomer's state tensors are the ones it
built. A receiver that holds a clean state of an older step (it was one step behind when a
peer died mid-step) receives into fresh tensors instead, and keeps its own until the last
byte has arrived: one more state on that rank for one step, so that the holders dying
mid-stream leave the job its older step rather than nothing (soak finding 13).
A receiver sitting the step out keeps the holders' buffers (BatchNorm's running
statistics) of the step before.

Why the receivers sit the landing step out rather than train their share once the model
has landed (as this module did until 2026-12-07): receiving the state costs a receiver CPU
(here) or link time in that step, and its first forward and backward in a fresh process are
slower than later ones, so the holders waited for it in the all-reduce; sitting out, it only
receives, and the holders' share grows by 1/(n-1) for one step, which shrinks as the job
grows. At 1.2 GB, 0.6 CPU a node, one thread a worker (``scripts/bench/recovery.py --cases
inproc-join --state-mb 1200 --kill-step 8 --ckpt-every 1000 --cores-per-node 0.6
--worker-threads 1``): the members' gap at the admission +0.43 to +1.60 s beyond a normal
step while the newcomer trained (5 trials; its forward and backward 1.36 s against 0.5-0.7 s,
the members waiting 1.1 s for it; median +0.95), +0.28 to +0.98 s sitting out (8 trials;
median +0.58 in the 5 at the change); with torch's default two threads a worker, +0.56 to
+1.11 s against +0.88 to +2.23 s.

Measured at 400 MB of AdamW state on 3 gloo ranks (2 shared cores): after a kill the restore
took 4.0 s when the whole state was broadcast, and takes 0.1 s with 0 bytes moved (the
decision itself, fingerprint and all-gather, ~2 ms; the rest is rebuilding the gradient
buckets). At a join of 1.2 GB (100M parameters, ``scripts/bench/recovery.py --cases
inproc-join --state-mb 1200``; a normal step 1.7-2.0 s) the members' restore took 3.0 s
when they waited for the transfer and takes 0.3-0.6 s now (the newcomer builds before it
registers, :meth:`ReplicatedTrainer.prepare`, and allocates rather than steps its
optimizer state); their longest gap between steps went from 6.7 s to 5.1-6.1 s. The rest
is the step the state lands in: on two cores shared by three workers the 1.2 GB stream
(1.9-3.0 s, done before the holders' backward ends) and the newcomer's first update
(3.9 s, 390,000 page faults) take the CPU the holders' all-reduce and update need (the
bench's workers run two threads each). With one thread per worker the streamed step took
1.7-1.9 s against a normal step's 2.2-2.4 s (3 ranks in one test pool, no agents): the
transfer itself hides in the step when the CPU is not oversubscribed. Over TCP connections
of its own (``tcp_stream.py``) the same bench's stream takes 0.5-0.6 s from its start to its
last byte (1.87-2.29 GB/s; 1.16-1.90 GB/s through gloo). A growth no longer waits for a
checkpoint save being written (``boundary_vote.Stop.SAVING``: the members train on; with a
save every 10 steps the re-form took 1.9-2.7 s before, 32-49 ms after), and the members' gap
at the join is 2.4 s, +0.7-0.8 s beyond a normal step. The bench now reports that gap
itself (the members' longest gap from their last step before the admitting round to three
steps after); two runs of 3 on 2026-12-07, one with a thread per worker
(``--worker-threads 1``): 2.32/2.50/2.90 s against a normal step of 1.41-1.51 s and a step
after the join of 2.25-2.58 s, and 2.11/3.31/2.83 s against 1.64-1.81 and 2.39-2.92 s with
torch's default threads: about the step after, +0.3-1.6 s beyond a normal one (on two cores
a third worker slows every step). The stream in those runs: 1.9-2.7 GB/s, 0.39-0.57 of the
best loopback connection (4.8 GB/s); alone (``scripts/bench/stream.py``) 4.7-5.3 GB/s.
With each node's worker held to 0.6 CPU (``--cores-per-node 0.6``), a newcomer that sat the
landing step out left the members +1.3 s beyond a normal step; training its share once its
model has landed, +1.0 to +1.4 s (+0.55 to +0.85 beyond a step after the join): on this
machine the landing step is slower on every rank in every part, AdamW's update most
(1.6-1.7 s of a 3.6 s step, 2.5-2.6 s there): each update faults its 800 MB of temporaries
in again, and those faults cost two to three times the system time when three processes
fault at once (that is the bench's former model, one 400 MB layer). Built of Linear(2048,
2048) layers, as issue 22 measured it, an update faults almost nothing, yet the join costs
more here: +1.4 to +2.6 s beyond a normal step, +0.8 to +1.9 beyond a step after (3 trials).
The newcomer's forward and backward take 2.6 s against the members' 2.0-2.1 s (its 1.2 GB
arrives within its own 0.6 CPU), the members wait 0.9 s for it in the all-reduce, and every
rank's update takes 1.6-2.4 s against 1.0-1.5 s before the join, 1.0-1.4 CPU-seconds
against 0.6-0.9: three processes updating 100M parameters at once share one memory bus
here, which a cluster's nodes do not (their updates stay at 1.6-1.7 s after the join). On
a GPU node the newcomer's share takes the holders' extra compute of that step away.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist


from elastic_rt.layout import Layout
from elastic_rt.worker.context import Context
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.checkpoint_restore import (
    from_checkpoint_or_init,
    load_checkpoint_into,
)
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.protocol import BuildFn, Progress, Restored, Restoring
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state
from elastic_rt.worker.trainers.replica_state import (
    Outline,
    named_tensors,
    receive_into,
    staging_for,
)
from elastic_rt.worker.trainers.replica_transfer import (
    CHUNK_BYTES,
    Agreement,
    Stream,
    agree,
    fingerprint,
)
from elastic_rt.worker.trainers.runtime_step import (
    ReplicatedStep,
    StepFn,
    StepOptions,
    initialize_optimizer_state,
)
from elastic_rt.worker.trainers.train_state_trainer import TrainStateTrainer

logger = logging.getLogger(__name__)


class ReplicatedTrainer(TrainStateTrainer):
    """A ``TrainState`` replicated on every data-parallel rank; the runtime does its step.

    Args:
        chunk_bytes: the most bytes one message of a restore carries.
    """

    def __init__(self, build: BuildFn, step_fn: StepFn, options: StepOptions, *,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.build, self.step_fn, self.options = build, step_fn, options
        self.chunk_bytes = chunk_bytes
        self.state: TrainState | None = None
        self.stepper: ReplicatedStep | None = None
        self.stream: Stream | None = None
        """The state on its way from the holders to the receivers, until the next update."""
        self._receiving: Progress | None = None
        """A receiver's position while its stream is in flight (dirty until it lands)."""
        self._prepared_for: Layout | None = None
        """The layout a state built ahead of the first round was built for."""
        self._staged: tuple[Outline, list[torch.Tensor], Callable[[], None]] | None = None
        """A receiver that kept its older state: the holders' outline, the fresh tensors
        its stream writes, and how to go back to the older position if it breaks."""

    def prepare(self, layout: Layout) -> bool:
        """Build before the admitting round, so the members do not wait on ``build`` in
        the restore's agreement (1.0-1.5 s for 100M parameters here). A build that fails
        outside a round (e.g. it reads ``context()``) is simply done in the round instead.

        Everything the newcomer's first step will touch is made here too, off the
        members' critical path: its optimizer state (the stream writes into it) and the
        gradient buckets, each page written once, and the optimizer's own temporaries
        (one step at lr 0 on zero gradients, which grows the heap to its working size).
        Made in the step the state lands in, they cost 390,000 page faults and 3.9 s at
        100M parameters, which the members then waited out before their next step."""
        try:
            self.state = self.build(layout)
        except Exception as exc:  # noqa: B902 - the round's build raises it again, as it must
            logger.info("build ahead of the round failed (%s); building in the round", exc)
            self.state = None
            return False
        self.stepper = ReplicatedStep(self.state, self.step_fn, self.options,
                                      stop_on_notice=True)
        initialize_optimizer_state(self.state.optimizer)
        self.stepper.bind(None)
        self._prepared_for = layout
        return True

    def restore(self, at: Restoring) -> Restored:
        prepared_for, self._prepared_for = self._prepared_for, None
        if self.state is None or self.stepper is None or prepared_for not in (None,
                                                                              at.ctx.layout):
            self.state = None  # a state built for another layout goes before the new one
            self.state = self.build(at.ctx.layout)
            self.stepper = ReplicatedStep(self.state, self.step_fn, self.options,
                                          stop_on_notice=True)
        state, stepper = self.state, self.stepper
        group = at.ctx.groups.world
        step = -1 if at.progress.is_dirty else at.progress.step
        held = fingerprint([t for _, t in named_tensors(state)]) if step >= 0 else 0
        agreement = agree(step, held, group)
        if agreement.step < 0:
            def init() -> None:  # rank 0's build is everybody's start
                state.model.load_state_dict(broadcast_state(state.model.state_dict(), 0, group))
            restored = Restored(from_checkpoint_or_init(
                at, lambda: load_checkpoint_into(state, at), state=state, stepper=stepper,
                last=agreement.step, init=init))
        elif agreement.is_settled:
            restored = Restored("kept", 0)
        else:
            restored = self._share(at, agreement, state, stepper)
        stepper.bind(at.ctx.groups.dp)
        return restored

    def _share(self, at: Restoring, agreement: Agreement, state: TrainState,
               stepper: ReplicatedStep) -> Restored:
        """Start the holders' state towards the receivers; it lands during the next step.

        The receivers take the holders' position and everything but the tensors' bytes at
        once (the small Outline), and are marked dirty until the stream has finished: a
        failure before then leaves them receivers in the next round.
        """
        group, first = at.ctx.groups.world, agreement.holders[0]
        me = dist.get_rank(group)
        outline: Outline = broadcast_state(
            Outline.of(state, at.meta(state, stepper)) if me == first else None, first, group)
        is_receiver = me in agreement.receivers
        if not is_receiver:
            tensors = self._to_send(state)
        elif (not at.progress.is_dirty and at.progress.step >= 0
              and (staging := staging_for(outline)) is not None):
            # A rank one step behind holds a whole older state: kept until the newer one
            # has landed whole, so that the holders lost mid-stream cost one step, not
            # the job (soak finding 13).
            own = at.meta(state, stepper)
            self._staged = (outline, staging, lambda: at.take(own, state, stepper))
            tensors = staging
        else:
            tensors = receive_into(state, outline)
        if is_receiver:
            at.take(TrainMeta.decode(outline.meta), state, stepper)
            at.progress.is_dirty = True  # its tensors are still arriving
        self.stream = stream = Stream(tensors, agreement, group, chunk_bytes=self.chunk_bytes)
        self._receiving = at.progress if is_receiver else None
        holders = ",".join(str(r) for r in agreement.holders)
        return Restored(f"rank{'s' if len(agreement.holders) > 1 else ''} {holders}",
                        stream.bytes, receiving=agreement.receivers,
                        sitting_out=agreement.receivers,
                        stream_seconds=lambda: stream.wire_seconds)

    @staticmethod
    def _to_send(state: TrainState) -> list[torch.Tensor]:
        """A holder's tensors as they go out: the state's own, except the model's buffers,
        copied now, because the next step's forward may write them (BatchNorm's running
        statistics) while they are still being sent; parameters and optimizer state change
        only in the update, after :meth:`_finish_stream`."""
        named = named_tensors(state)
        params = {f"model.{name}" for name, _ in state.model.named_parameters()}
        return [t.detach().clone() if name.startswith("model.") and name not in params else t
                for name, t in named]

    def _finish_stream(self) -> None:
        """Before the update: every byte of a stream in flight has left or arrived."""
        stream = self.stream
        if stream is None:
            return
        stream.finish()  # if it raises, release() gives the stream up
        self.stream = None
        if self._staged is not None:
            assert self.state is not None
            outline, staging, _ = self._staged
            self._staged = None
            with torch.no_grad():
                for tensor, arrived in zip(receive_into(self.state, outline), staging):
                    tensor.copy_(arrived)
        if self._receiving is not None:
            self._receiving.is_dirty = False  # holds the holders' step now
            wire = stream.wire_seconds or stream.seconds or 0.0
            logger.info("received %d bytes of state in %.2f s (%.0f MB/s) while the holders "
                        "trained", stream.bytes, wire, stream.bytes / max(wire, 1e-9) / 1e6)
        self._receiving = None

    def release(self) -> None:
        """A stream still in flight is a failed step's (the loop trains the step a stream
        lands in before it looks at newer rounds): it is dropped, not waited for, since its
        peer may be gone; a receiver stays dirty, and receives again in the next round."""
        if self.stream is not None:
            logger.warning("the state stream to the receivers broke off; they receive again")
            self.stream.give_up()  # before the next round's restore writes the tensors
        if self._staged is not None and self._receiving is not None:
            self._staged[2]()  # back to the older state it kept, clean
            self._receiving.is_dirty = False
            logger.warning("kept this rank's state of step %d for the next round",
                           self._receiving.step)
        self.stream, self._receiving, self._staged = None, None, None
        super().release()

    def compute_seconds(self) -> float | None:
        return self.stepper.compute_seconds if self.stepper is not None else None

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.stepper is not None
        loss = self.stepper.run(micro_batches, global_len=global_len, rank=ctx.rank, step=step,
                                before_update=self._finish_stream)
        return loss.local_mean, loss.contribution
