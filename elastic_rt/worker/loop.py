"""The elastic loop: the user owns the step, the runtime owns recovery.

``run(build=..., step=..., dataset=..., global_batch_size=..., max_steps=...)``
reads top to bottom like a plain training loop; each recovery phase is a named
call, and each round is one value (``worker/joined_round.py``)::

    round = membership.current()               # the agents' round, or the env's only one
    loop:
        joined = reform_groups(round)          # store + torch process groups, as one value
        restore(joined)                        # from survivors, else the checkpoint
        resplit(joined)                        # sampler over the new dp ranks
        train until done, a failed collective, or a newer round
        round = wait_for_round(after=round)    # agents decide membership

A failed collective (a peer died) never reaches the user's code: the step is
retried in the next round, from the state of the most advanced survivor, with the
same global batch. Only errors the runtime cannot recover from are raised: the
same step failing ``max_failed_steps`` times, or no new round in time. Outside
``elastic-rt launch`` the membership is fixed (``worker/static_membership.py``): the
same loop runs, and a failed collective ends the job.

Around the user's step the runtime averages gradients in buckets that reduce while
backward runs (``worker/grad_sync.py``), weighting each rank's loss by its share so the
gradient is exactly the global-batch mean whatever the split; batches come from a
``DataLoader`` over the ``ElasticSampler`` (``worker/batches.py``), re-split at every
re-form; autocast, clipping, the optimizer and the LR scheduler are applied
(``worker/trainers/runtime_step.py``). An exception from the user's own code (dataset,
step, model) is not a lost peer: the job ends at once, on every node, with that traceback
and a one-line root cause (``worker/failures.py``).

**Reports.** Rank 0 keeps the run's ``layout`` and ``progress`` keys current for
``elastic-rt status`` (``worker/progress.py``); a watchdog names a rank that completes
no step for ``hang_factor`` median step times and dumps its stacks (``worker/hang.py``).
``step.completed`` carries ``loss``, the mean over this rank's samples (for an object
owning its step, what its ``step`` returned), and with ``on_step``, ``global_loss``.

**Objects that own their step** (``step=None``): for model parallelism, ``build(layout)``
returns an object with ``step(batch) -> float``, ``state_dict()`` and
``load_state_dict()`` that takes its groups from :func:`elastic_rt.context` and does
its own forward, backward, reduction and optimizer step on this rank's share of the
global batch. The layout is re-planned from ``limits`` and the object rebuilt every
round. Its state comes from surviving ranks when they hold every part of one cut at one
step (``trainers/model_parallel/part_broadcast.py``), else from the newest committed
checkpoint, loaded into the new layout: the step counter and sampler roll back with it
(work lost <= the checkpoint interval).
"""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from elastic_rt.accelerator import use_worker_device
from elastic_rt.config import DEFAULT_REFORM_TIMEOUT, WorkerEnv
from elastic_rt.errors import (
    CheckpointError,
    ElasticError,
    FencedOutError,
    NewerRound,
    NodeLeaving,
    RendezvousClosedError,
    RoundAbandoned,
    StateLostError,
    StoreError,
    UserCodeError,
)
from elastic_rt.events import EventSink
from elastic_rt.layout import ModelLimits, plan_layout
from elastic_rt.rendezvous.checkpoint_pointer import FencedPointer
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.abort import loses_a_rank, round_notice, waited_seconds
from elastic_rt.worker.allocator import (
    REPLICATED_TRIM_THRESHOLD_BYTES,
    SHARDED_TRIM_THRESHOLD_BYTES,
    HeapTrimmer,
    pin_heap,
)
from elastic_rt.worker.batches import BatchSource, LoaderOptions, MapDataset, check_dataset
from elastic_rt.worker.failures import end_job, user_code
from elastic_rt.worker.footprint import footprint
from elastic_rt.worker.grad_sync import GradSync
from elastic_rt.worker.hang import HangWatchdog, report_stall
from elastic_rt.worker.joined_round import JoinedRound, close_round, collective_timeout, join
from elastic_rt.worker.boundary_vote import BoundaryVote, Stop
from elastic_rt.worker.progress import ProgressPublisher, StepClock, StepReport, published_step
from elastic_rt.worker.run_options import RunOptions
from elastic_rt.worker.rss_peak import RssPeak
from elastic_rt.worker.trainers import (
    BuildFn,
    Progress,
    Restoring,
    StepFn,
    StepOptions,
    Trainer,
    choose,
)
from elastic_rt.worker.context import set_context
from elastic_rt.worker.membership import Membership
from elastic_rt.worker.static_membership import start_membership
from elastic_rt.worker.stragglers import Balancer, Stragglers

if TYPE_CHECKING:  # a worker loads these only for jobs that use them (pipelining, DCP: seconds)
    from elastic_rt.checkpoint import Checkpointer
    from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel

logger = logging.getLogger(__name__)


def run(
    *,
    build: BuildFn,
    step: StepFn | None,
    dataset: MapDataset,
    global_batch_size: int,
    max_steps: int,
    checkpoint: Checkpointer | None = None,
    seed: int = 0,
    micro_batch_size: int | None = None,
    limits: ModelLimits = ModelLimits(),
    max_failed_steps: int = 3,
    reform_timeout: timedelta = DEFAULT_REFORM_TIMEOUT,
    collate: Callable[[list[Any]], Any] = default_collate,
    loader: LoaderOptions | None = None,
    grad_sync: GradSync = GradSync(),
    autocast_dtype: torch.dtype | None = None,
    clip_grad_norm: float | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    peer_copy_every: int = 1,
    stragglers: Stragglers = Stragglers(),
    model_parallel: ModelParallel | None = None,
) -> Any:
    """Train ``max_steps`` steps elastically; returns this rank's final state.

    Args:
        build: makes model and optimizer for a layout; called on a rank's first
            round only (survivors keep theirs). With ``step=None`` it returns a
            :class:`SteppedModel` instead, rebuilt after every re-form.
        step: returns the mean loss over the batch it is given; the runtime does
            backward, gradient reduction and the optimizer step. None: the object
            ``build`` returns owns its step (model parallelism).
        dataset: a map-style dataset (``len`` and indexing).
        global_batch_size: samples per optimizer step over all ranks; fixed.
        checkpoint: saves every ``every_steps`` and restores when no replica survives.
        micro_batch_size: the most samples per forward/backward (accumulation);
            with ``model_parallel`` the pipeline's micro-batches, or at pp1 one
            forward/backward each, reduced once; not with an object owning its step.
        limits: what the model allows; the layout is planned from it every round.
        max_failed_steps: the same step failing this often is raised, not retried.
        reform_timeout: the most to wait for a round that includes this node.
        collate: turns a micro-batch's samples into a batch (``loader`` overrides it).
        loader: ``DataLoader`` settings (worker processes, prefetch, pinned memory).
        grad_sync: gradient bucket sizes and the reduction hook.
        autocast_dtype: run ``step`` under autocast (float16 adds a GradScaler);
            under FSDP, its mixed precision. With ``model_parallel`` bfloat16 only:
            FSDP's mixed precision in a sharded round, autocast in the others.
        clip_grad_norm: clip the averaged gradients to this global norm.
        on_step: called after every committed step with a :class:`StepReport`
            (costs one small all-reduce per step for the global loss).
        peer_copy_every: under FSDP (``limits.max_shard > 1``, no replica), and under
            ``model_parallel`` where a part has no replica on another node, snapshot each
            rank's shards or part and copy them to a rank on the next node every this many
            steps, so a node loss redoes at most this many steps without reading storage
            (0: off; see ``sharded/peer_copies.py``, ``runtime_parallel/copies.py``).
        stragglers: when a rank persistently slower than the others trains a smaller
            share of the same global batch, and when it is evicted
            (``worker/stragglers.py``; replicated data parallelism).
        model_parallel: with ``step=None``, the runtime builds pipeline and tensor
            parallelism from the :class:`ModelDescription` ``build`` returns, re-planned
            every round (the schedule and micro-batches; ``docs/parallelism.md``).

    Raises:
        ElasticError: recovery is impossible (budget spent, no round in time).
        ConfigError: bad arguments (one clear line).
        UserCodeError: the user's code raised; the job was ended on every node.
    """
    checked = RunOptions(
        global_batch_size=global_batch_size, max_steps=max_steps, is_step_owned=step is None,
        is_runtime_parallel=model_parallel is not None,
        seed=seed, micro_batch_size=micro_batch_size, limits=limits,
        max_failed_steps=max_failed_steps, reform_timeout=reform_timeout,
        autocast_dtype=autocast_dtype, clip_grad_norm=clip_grad_norm,
    )  # fmt: skip
    check_dataset(dataset)
    # A steady heap over a long run; under FSDP one that keeps a step's gathered parameters
    # and gradients for the next step instead of trimming them (worker/allocator.py).
    pin_heap(trim_threshold_bytes=SHARDED_TRIM_THRESHOLD_BYTES if checked.is_sharded
             else REPLICATED_TRIM_THRESHOLD_BYTES)
    sampler = ElasticSampler(len(dataset), global_batch_size=global_batch_size, seed=seed,
                             micro_batch_size=micro_batch_size)
    options = StepOptions(grad_sync=grad_sync, autocast_dtype=autocast_dtype,
                          clip_grad_norm=clip_grad_norm,
                          accumulates=micro_batch_size is not None)
    trainer = choose(build=build, step=step, limits=limits, options=options,
                     peer_copy_every=peer_copy_every, model_parallel=model_parallel)
    loop = _ElasticLoop(
        checked, trainer=trainer, checkpoint=checkpoint, sampler=sampler,
        batches=BatchSource(dataset, sampler, loader or LoaderOptions(collate_fn=collate)),
        on_step=on_step, balancer=Balancer(stragglers),
    )  # fmt: skip
    return loop.run()


def _will_save(checkpoint: Checkpointer | None, max_steps: int) -> TypeGuard[Checkpointer]:
    """Whether a run of ``max_steps`` saves ``checkpoint`` at least once."""
    return checkpoint is not None and 0 < checkpoint.every_steps <= max_steps


class _ElasticLoop:
    def __init__(self, options: RunOptions, *, trainer: Trainer,
                 checkpoint: Checkpointer | None, sampler: ElasticSampler,
                 batches: BatchSource, on_step: Callable[[StepReport], None] | None,
                 balancer: Balancer) -> None:
        self.options, self.trainer, self.sampler = options, trainer, sampler
        self.batches, self.on_step, self.balancer = batches, on_step, balancer
        self.env = WorkerEnv.from_env()
        use_worker_device(self.env.local_rank)  # cuda:LOCAL_RANK is current before build runs
        self.events = EventSink(self.env.events_file, source="worker", run_id=self.env.run_id,
                                node=self.env.node_id, rank=self.env.rank)
        self._user_checkpoint = checkpoint  # the standby's _prepare reserves its staging
        self.membership = start_membership(self.env, prepare=self._prepare)
        self.collective_timeout = collective_timeout(self.env)
        self.joined: JoinedRound | None = None
        """The round we train in; None before the first and between two rounds."""
        self.progress = Progress()
        self.receiving: tuple[int, ...] = ()
        """Data-parallel ranks whose state lands in this step (a join's stream)."""
        self.sitting_out: tuple[int, ...] = ()
        """Those of them training no samples this step (``Restored.sitting_out``)."""
        self._step_samples = 0
        """This rank's samples in the step just trained (its speed's numerator)."""
        self._restored_at = 0.0  # for state.landed: when the restore ended, what it moved
        self._streamed_bytes: int | None = None
        self._stream_seconds: Callable[[], float | None] | None = None
        self._save_began: float | None = None
        """When the last save began (monotonic)."""
        self._state_streamed_in = False
        """Whether this process joined a running job (its state came from the others)."""
        self._growth_waits = 0
        """Boundaries the ranks have trained past a newer round, waiting for a save."""
        self.clock = StepClock()
        self.heap = None if options.is_sharded else HeapTrimmer()
        self.watchdog = HangWatchdog(self.clock, self.env.hang_factor, self._report_stall)
        registry = self.membership.registry
        self.publisher = ProgressPublisher(registry) if registry is not None else None
        self.checkpoint = self._for_run(checkpoint, registry)
        self.vote = BoundaryVote(self.membership.leave_note)

    def _prepare(self, membership: Membership) -> None:
        """A standby worker builds its state before its node registers, for the layout of
        the round that will most likely admit it: the current one plus this node's ranks,
        or for a spare (the round is full) the current one, whose lost member it replaces
        (a wrong guess is built again in the round)."""
        if self.env.in_round or membership.registry is None:
            return
        try:
            current = membership.registry.current_round()
        except StoreError as exc:  # built in the round instead
            logger.warning("no build ahead of the round: etcd failed a read (%s)", exc)
            return
        world = current.world_size if current is not None else 0
        is_full = current is not None and len(current.members) >= self.env.max_nodes > 0
        # a member without ranks (its workers replaced at the minimum node count) gets its
        # ranks back; a spare replaces a lost member of a full round
        is_member = current is not None and self.env.node_id in current.members
        if not is_full or is_member:
            world += self.env.local_world_size
        if world < 1:
            return
        began = time.monotonic()
        built = self.trainer.prepare(plan_layout(world, self.options.limits))
        logger.info("built ahead of the round for %d ranks in %.2f s", world,
                    time.monotonic() - began)
        if built and _will_save(self._user_checkpoint, self.options.max_steps):
            # The first save's staging buffers too, here where nobody waits: made by that
            # save (or beside the first steps, see _after_step) on a node that joined a
            # running job, the members waited for its fault-in in the next all-reduce.
            began = time.monotonic()
            if self._user_checkpoint.reserve_staging(self.trainer.checkpoint_state,
                                                     background=False):
                logger.info("made the first save's staging buffers ahead of the round in "
                            "%.2f s", time.monotonic() - began)

    def _for_run(self, checkpoint: Checkpointer | None,
                 registry: RunRegistry | None) -> Checkpointer | None:
        """The user's checkpointer, committing through the run's fenced pointer.

        Outside ``elastic-rt launch`` (no run keys) the user's, as the user made it.
        """
        if checkpoint is None or registry is None:
            return checkpoint
        return checkpoint.for_run(
            pointer=FencedPointer(registry, checkpoint.url), events=self.events,
            collective_timeout=self.collective_timeout,
            round_of=lambda: self.joined.number if self.joined else None)

    # the loop -------------------------------------------------------------------
    def run(self) -> Any:
        try:
            round_ = self.membership.current()
        except RendezvousClosedError as exc:  # a spare whose job ended without it
            logger.info("%s", exc)
            raise SystemExit(0) from None
        try:
            while True:
                try:
                    joined = self.reform_groups(round_)
                    self.restore(joined)
                    self.resplit(joined)
                    self.train(joined)
                    break
                except NodeLeaving as leaving:
                    # Its state handed over and its agent told: the worker ends here, and
                    # not through run()'s return, after which the script would go on as if
                    # the job were done.
                    logger.info("this node leaves after step %d", leaving.step)
                    raise SystemExit(0) from None
                except NewerRound:
                    logger.info("newer round pending; re-forming at step %d", self.progress.step)
                except (UserCodeError, StateLostError) as exc:
                    end_job(exc, registry=self.membership.registry, events=self.events,
                            round=self.joined.number if self.joined else None)
                except (RoundAbandoned, RuntimeError, dist.DistError) as exc:
                    # RuntimeError, DistError: torch's own for a failed collective.
                    self._release_groups(abandon=True)  # first: on_failure may raise
                    self.on_failure(round_, exc)
                try:
                    round_ = self.wait_for_round(round_)
                except RendezvousClosedError as exc:
                    logger.error("%s", exc)  # its root cause is the agents' and the failed rank's
                    raise SystemExit(1) from None
            self._finish_checkpoint()
        finally:
            self.shutdown()
        return self.trainer.result()

    def train(self, joined: JoinedRound) -> None:
        self.clock.resume(time.monotonic())
        self.watchdog.arm()
        try:
            self._train(joined)
        finally:
            self.watchdog.disarm()
        self._publish_progress(force=True)

    def _train(self, joined: JoinedRound) -> None:
        while self.progress.step < self.options.max_steps:
            began, waited = time.perf_counter(), waited_seconds()
            # A newer round is joined at a boundary every rank votes for (boundary_vote),
            # and waits for the step a stream lands in: that step finishes it.
            newer = not self.receiving and self.membership.has_newer_round(joined.number)
            # a restore may leave it dirty: a receiver whose streamed state lands in this step
            self.progress.is_dirty = self.progress.is_dirty or not self.trainer.is_step_atomic()
            joined.at_step(self.progress.step + 1)
            self.vote.begin(joined.groups.world, newer_round=newer, saving=self._saving())
            local_loss, contribution = self.train_step(joined)
            self.sampler.advance()
            self.progress.step += 1
            self.progress.is_dirty = False
            self.progress.failed_attempts = 0
            self.clock.completed(time.monotonic())
            if self.receiving:  # their state has landed: the whole world trains from now
                wire = self._stream_seconds() if self._stream_seconds else None
                self._phase("state.landed", self._restored_at, receiving=list(self.receiving),
                            sitting_out=list(self.sitting_out), bytes_moved=self._streamed_bytes,
                            **({} if wire is None else {"stream_ms": round(wire * 1000)}))
                if self.sitting_out:
                    self.sitting_out = ()
                    self.resplit(joined)
                self.receiving = ()
            # Summed only now: the update is applied, so a peer lost during this sum must
            # not make the next round train the step again (it loses only the global loss:
            # the step is still reported done, or a log would show it skipped).
            try:
                global_loss = self._global_loss(joined, contribution) if self.on_step else None
            except BaseException:
                self._report_completed(joined, local_loss, None)
                raise
            self._after_step(joined, local_loss, global_loss)
            if self.progress.step >= self.options.max_steps:
                break
            stop = self.vote.outcome()
            if stop & Stop.LEAVE:
                self.leave_together(joined)
            if stop & Stop.NEWER_ROUND:
                self._join_newer_unless_saving(stop)
            if self.balancer.record(self._step_samples, self._busy_since(began, waited)):
                self._rebalance(joined)

    def _saving(self) -> bool:
        """This rank's ``SAVING`` flag: its save is still being written, and began less than
        a quarter of the re-form timeout ago (a newcomer waits for the members in the newer
        round's rendezvous meanwhile; a save that outlasts that is waited for, as before)."""
        return (self.checkpoint is not None and self._save_began is not None
                and self.checkpoint.is_writing and time.monotonic() - self._save_began
                < self.options.reform_timeout.total_seconds() / 4)

    def _join_newer_unless_saving(self, stop: Stop) -> None:
        """Join the newer round every rank voted for (:class:`NewerRound`), unless a save
        is being written on this round's groups: then train on and ask again next step.

        Every rank decides alike: ``SAVING`` is the vote's; a save begun at this very
        boundary (after the vote was sent) is one every rank began, the step's, and holds
        the first boundary of the wait only, so that saves every step cannot hold it.
        """
        begun_now = (self._growth_waits == 0 and self.checkpoint is not None
                     and self.checkpoint.async_save
                     and self.checkpoint.should_save(self.progress.step))
        if not (stop & Stop.SAVING or begun_now):
            self._growth_waits = 0
            raise NewerRound()
        self._growth_waits += 1

    def _busy_since(self, began: float, waited: float) -> float | None:
        """This step's wall time less its waits on peers (the straggler's measure); None
        where the trainer's collectives run inside its forward, untimed."""
        if self.trainer.compute_seconds() is None:
            return None
        return (time.perf_counter() - began) - (waited_seconds() - waited)

    # recovery phases --------------------------------------------------------------
    def reform_groups(self, round_: Round) -> JoinedRound:
        began = time.monotonic()
        # A save in flight uses this round's groups: let it finish (or fail) on every rank
        # first. Else it breaks on some ranks only, and their next save() raises that error
        # before the save's first collective, leaving the other ranks waiting in it.
        self._finish_checkpoint()
        self._release_groups()
        released = time.monotonic()
        self.events.rank = self.membership.rank_in(round_)  # this round's, not the first's
        self.joined, timings = join(
            round_, membership=self.membership, env=self.env, limits=self.options.limits,
            reform_timeout=self.options.reform_timeout,
            collective_timeout=self.collective_timeout)  # fmt: skip
        ctx = self.joined.ctx
        self.membership.acknowledge(round_)
        if self.publisher is not None and ctx.rank == 0:
            value = {"round": ctx.round, "layout": ctx.layout.to_dict()}
            self.publisher.commit("layout", json.dumps(value), ctx.token)
        # Where the time went: the previous round's teardown, finding the store (address and
        # connect), waiting for the slowest rank, and building the groups (gloo's mesh).
        self._phase("groups.reformed", began, world_size=ctx.world_size, layout=str(ctx.layout),
                    release_ms=int((released - began) * 1000), **timings,
                    footprint=footprint())
        return self.joined

    def restore(self, joined: JoinedRound) -> None:
        began, peak = time.monotonic(), RssPeak()
        restored = self.trainer.restore(Restoring(ctx=joined.ctx, checkpoint=self.checkpoint,
                                                  sampler=self.sampler, progress=self.progress,
                                                  run_reached=self._published_step))
        self.receiving, self.sitting_out = restored.receiving, restored.sitting_out
        self._state_streamed_in |= joined.ctx.dp_rank in restored.receiving
        self._restored_at, self._streamed_bytes = time.monotonic(), restored.bytes_moved
        self._stream_seconds = restored.stream_seconds
        streaming: dict[str, Any] = {"receiving": list(restored.receiving),
                                     "sitting_out": list(restored.sitting_out)}
        # the RSS growth covers the restore itself; a stream's bytes land later, in a step
        self._phase("state.restored", began, source=restored.source,
                    bytes_moved=restored.bytes_moved, rss_growth_bytes=peak.growth_bytes(),
                    **(streaming if self.receiving else {}))

    def _published_step(self) -> int:
        return published_step(self.membership.registry)

    def resplit(self, joined: JoinedRound) -> None:
        """The global batch over the ranks that train it: all, except the ranks sitting out
        the step their state lands in (who keep their own split, and draw no samples)."""
        ctx = joined.ctx
        training = [r for r in range(ctx.dp_size) if r not in self.sitting_out]
        if ctx.dp_rank in training:
            self.sampler.set_world(training.index(ctx.dp_rank), len(training))
        else:
            self.sampler.set_world(ctx.dp_rank, ctx.dp_size)
        self.balancer.reset()  # equal shares again: the speeds are measured anew
        self.batches.reset()  # batches prefetched for the old split are dropped

    def _rebalance(self, joined: JoinedRound) -> None:
        """A window ended on every rank at this step: re-split by speed, maybe evict."""
        ctx, step = joined.ctx, self.progress.step
        verdict = self.balancer.agree(joined.groups.dp, self.sampler.weights)
        nodes = [joined.round.node_of_rank(dist.get_global_rank(joined.groups.dp, r))
                 for r in range(ctx.dp_size)]
        if verdict.weights != self.sampler.weights:
            self.sampler.set_weights(verdict.weights)
            self.batches.reset()
            self.events.emit("shares.rebalanced", round=ctx.round, step=step, nodes=nodes,
                             weights=verdict.weights,
                             speeds=[round(v, 1) for v in verdict.speeds])
            if self.publisher is not None and ctx.rank == 0:
                value = {"round": ctx.round, "step": step, "nodes": nodes,
                         "weights": verdict.weights}
                self.publisher.commit("shares", json.dumps(value), ctx.token)
        if verdict.evict is None or ctx.dp_rank != 0:
            return
        try:
            evicted = self.membership.evict(nodes[verdict.evict])
        except StoreError as exc:  # the next window asks again
            logger.warning("could not evict the straggler %s: %s", nodes[verdict.evict], exc)
            return
        if evicted:
            self.events.emit("node.evicted", round=ctx.round, step=step,
                             evicted=nodes[verdict.evict], liveness="straggler",
                             speed=round(verdict.speeds[verdict.evict], 1))

    def leave_together(self, joined: JoinedRound) -> None:
        """Every rank stops at this boundary: some node leaves (its agent was told to).

        While all are still here, the checkpoint in flight commits (its background
        collectives need every rank) and the state goes where the others can restore this
        step without the leaver (``Trainer.hand_over``: FSDP's pieces to peer copies).
        Then the leaver's workers say so to their agent, which writes the round without
        its node; the others wait for that round: one re-form, nothing redone.

        Raises:
            NodeLeaving: on the leaver's ranks.
            NewerRound: on the others (wait for the round without the leaver).
        """
        began, step = time.monotonic(), self.progress.step
        self._finish_checkpoint()
        self.trainer.hand_over(joined.ctx, step)
        leaving = self.vote.is_mine
        self._phase("leave.agreed", began, leaving=leaving, source=self.vote.source)
        if leaving:
            self.membership.left(step)
            raise NodeLeaving(step)
        self.progress.paused_at = began  # step.resumed reports the pause from here
        raise NewerRound()

    def on_failure(self, round_: Round, exc: BaseException) -> None:
        self.progress.failed_attempts += 1
        self.progress.paused_at = time.monotonic()
        logger.warning("step %d failed in round %s: %s", self.progress.step + 1, round_.number,
                       str(exc).splitlines()[0] if str(exc) else exc)
        self.events.emit("step.retried", round=round_.number, step=self.progress.step + 1,
                         error=type(exc).__name__, attempt=self.progress.failed_attempts)
        if self.progress.failed_attempts >= self.options.max_failed_steps:
            raise ElasticError(
                f"step {self.progress.step + 1} failed {self.progress.failed_attempts} times"
            ) from exc
        self.membership.report_failure(round_)

    def wait_for_round(self, round_: Round) -> Round:
        began = time.monotonic()
        new_round = self.membership.wait_for_round(round_.number, self.options.reform_timeout)
        if self.progress.failed_attempts and loses_a_rank(round_, new_round):
            # The step failed because a peer was lost, not because of the step: it does not
            # count against max_failed_steps (a soak lost its last holder's state when three
            # nodes died one after another during one step: "step 1141 failed 3 times").
            # The job's restart budget still counts the workers lost.
            self.progress.failed_attempts -= 1
        self._phase("round.formed", began, round=new_round.number, world_size=new_round.world_size)
        return new_round

    # one training step ------------------------------------------------------------
    def train_step(self, joined: JoinedRound) -> tuple[float, float]:
        """(this rank's mean loss, its part of the global-batch mean) of one step."""
        step = self.progress.step + 1
        # Seeded per step, not per process: a retried or re-split step draws the same numbers.
        torch.manual_seed(self.options.seed * 1_000_003 + step)
        with user_code(rank=joined.ctx.rank, step=step):
            sits_out = joined.ctx.dp_rank in self.sitting_out
            micro_batches = [] if sits_out else self.batches.next_step()
        self._step_samples = sum(size for _, size in micro_batches)
        return self.trainer.train(micro_batches, global_len=len(self.sampler.global_batch()),
                                  ctx=joined.ctx, step=step)

    def _global_loss(self, joined: JoinedRound, contribution: float) -> float:
        """The global-batch mean loss: the sum of every data-parallel rank's part."""
        total = torch.tensor([contribution], dtype=torch.float64)
        if dist.get_world_size(joined.groups.dp) > 1:
            work = dist.all_reduce(total, group=joined.groups.dp, async_op=True)
            assert work is not None  # async_op=True always returns a Work
            round_notice().wait(work.get_future())
        return float(total)

    def _after_step(self, joined: JoinedRound, loss: float, global_loss: float | None) -> None:
        ctx, step = joined.ctx, self.progress.step
        if self.progress.paused_at is not None:
            downtime = time.monotonic() - self.progress.paused_at
            self.events.emit("step.resumed", round=ctx.round, step=step,
                             downtime_ms=int(downtime * 1000), world_size=ctx.world_size)
            self.progress.paused_at = None
        if self.heap is not None:
            self.heap.after_step()
        # The event first: the progress published lets a waiting node ask to join, and the
        # log should show the step before the round that follows from it.
        self._report_completed(joined, loss, global_loss)
        self._publish_progress()
        if self.on_step is not None and global_loss is not None:
            self.on_step(StepReport(step=step, loss=global_loss, local_loss=loss,
                                    world_size=ctx.world_size, round=ctx.round))
        if (_will_save(self.checkpoint, self.options.max_steps)
                and not self.checkpoint.should_save(step)
                and not self._state_streamed_in):
            # A save will come: its staging buffers are made beside the next steps, not by
            # the first save in the training thread; after a step, when the optimizer's
            # state exists (AdamW makes its moments in the first step), once per process
            # (a standby made them already, in _prepare). Not on a rank that joined a
            # running job without them: on CPUs the others would wait for it in every
            # step the buffers take (1.2 GB at 0.6 CPU: 6-7 s steps after a join, against
            # 3.5 s); its first save makes them.
            self.checkpoint.reserve_staging(self.trainer.checkpoint_state)
        if self.checkpoint is not None and self.checkpoint.should_save(step):
            self._save_began = time.monotonic()
            try:
                self.checkpoint.save(
                    step, self.trainer.checkpoint_state(), layout=ctx.layout.to_dict(),
                    extra=self.trainer.checkpoint_meta(step=step, sampler=self.sampler).encode(),
                    process_group=joined.groups.world, fence=joined.fence,
                )  # fmt: skip
            except (FencedOutError, CheckpointError) as exc:
                # The previous save did not commit; the one before it stays the latest.
                logger.warning("checkpoint before step %d not committed: %s", step, exc)
            # A save is not a step: its time neither makes the next step look slow nor,
            # when it is long, a hang (a save that never returns is still reported).
            self.clock.resume(time.monotonic())

    def _report_completed(self, joined: JoinedRound, loss: float,
                          global_loss: float | None) -> None:
        ctx, extra = joined.ctx, {} if global_loss is None else {"global_loss": global_loss}
        self.events.emit("step.completed", round=ctx.round, step=self.progress.step,
                         loss=None if math.isnan(loss) else loss,
                         world_size=ctx.world_size, **extra)

    def _publish_progress(self, *, force: bool = False) -> None:
        """Rank 0 keeps the run's ``progress`` key current for ``elastic-rt status``."""
        joined = self.joined
        if self.publisher is not None and joined is not None and joined.ctx.rank == 0:
            self.publisher.publish(step=self.progress.step, round_=joined.number,
                                   token=joined.ctx.token, clock=self.clock, force=force)

    def _report_stall(self, stalled_s: float, threshold_s: float) -> None:
        """From the watchdog thread: name this rank, then dump its stacks into the log.

        Not while a newer round is pending: a lost peer explains the wait, and the
        re-form it leads to is reported by its own events.
        """
        joined = self.joined  # read once: the training thread may let go of it meanwhile
        if joined is not None and self.membership.has_newer_round(joined.number):
            return
        report_stall(stalled_s, threshold_s, events=self.events, env=self.env,
                     rank=joined.ctx.rank if joined else self.env.rank,
                     round_=joined.number if joined else None, step=self.progress.step)

    def _finish_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        try:
            self.checkpoint.wait()
        except (FencedOutError, CheckpointError, RuntimeError) as exc:
            # RuntimeError: a peer died under the write; the previous commit stays the latest.
            logger.warning("last checkpoint not committed: %s", exc)

    # helpers ------------------------------------------------------------------------
    def _release_groups(self, *, abandon: bool = False) -> None:
        """Let go of the round we trained in, as a whole and at once (``close_round``).

        The context goes first: a context still holding the groups kept a survivor's
        peers waiting out their full timeout (gloo closes a group's sockets only when
        the last reference to it goes).
        """
        joined, self.joined = self.joined, None
        set_context(None)
        self.trainer.release()  # e.g. gradient buckets hold the group
        close_round(joined, abandon=abandon)

    def _phase(self, name: str, began: float, *, round: int | None = None,
               **metadata: Any) -> None:
        """Emit ``name`` with its duration; ``round`` defaults to the current one."""
        if round is None and self.joined is not None:
            round = self.joined.number
        now = time.monotonic()
        self.events.emit(name, round=round, step=self.progress.step,
                         duration_ms=int((now - began) * 1000), **metadata)

    def shutdown(self) -> None:
        # context() keeps describing the last round, so the script can tell its final rank.
        self.watchdog.close()
        self.batches.close()
        self.trainer.release()
        joined, self.joined = self.joined, None
        close_round(joined, abandon=False)
        if self.publisher is not None:
            self.publisher.close()  # before the follower's client, which it writes through
        self.membership.close()
