"""The elastic loop: the user owns the step, the runtime owns recovery.

``run(build=..., step=..., dataset=..., global_batch_size=..., max_steps=...)``
reads top to bottom like a plain training loop; each recovery phase is a named
call::

    round = first round the agent started us in
    loop:
        groups = reform_groups(round)          # store + torch process groups
        restore()                              # broadcast from a survivor, else checkpoint
        resplit()                              # sampler over the new dp ranks
        train until done, a failed collective, or a newer round
        round = wait_for_round(after=round)    # agents decide membership

A failed collective (a peer died) never reaches the user's code: the step is
retried in the next round, from the state of the most advanced survivor, with the
same global batch. Only errors the runtime cannot recover from are raised: the
same step failing ``max_failed_steps`` times, or no new round in time.

Gradients are averaged by the runtime over the data-parallel group in buckets that
start reducing while backward still runs (``worker/grad_sync.py``); each rank's loss
is weighted by its share, which keeps the global batch size fixed and the gradient
exactly the global-batch mean whatever the split. Batches come from a torch
``DataLoader`` over the ``ElasticSampler`` (``worker/batches.py``), re-split at every
re-form. Around the user's step the runtime applies autocast (with a GradScaler for
float16), clipping after the average, the optimizer and the LR scheduler
(``worker/replicated.py``).

An exception from the user's own code (dataset, step, model) is not a lost peer: the
job ends at once, on every node, with that traceback and a one-line root cause
(``worker/failures.py``); only failed collectives are retried.

**Reports.** Rank 0 keeps the run's ``layout`` and ``progress`` (step, step rate) keys
current for ``elastic-rt status`` (``worker/progress.py``); a watchdog thread names a rank
that completes no step for ``hang_factor`` median step times and dumps its Python stacks
(``worker/hang.py``).

**Events.** ``step.completed`` carries ``loss``, the mean loss over this rank's samples
of the step (for an object owning its step, what its ``step`` returned), and, when an
``on_step`` callback is given, ``global_loss``, the mean over the whole global batch.

**Objects that own their step** (``step=None``): for model parallelism, where a
rank holds a pipeline stage or a tensor shard, ``build(layout)`` returns an
object with ``step(batch) -> float``, ``state_dict()`` and ``load_state_dict()``
(it takes its process groups from :func:`elastic_rt.context`). It does its own
forward, backward, gradient reduction and optimizer step on this rank's
data-parallel share of the global batch (every stage of a replica gets the same
share). The layout is re-planned from ``limits`` every round, and the object is
rebuilt after every re-form, since the old one is bound to destroyed groups. Its
state then comes from surviving ranks when they hold every shard of the same cut
at one step (see ``shard_sync``); otherwise, e.g. when a node holding a whole
pipeline stage is lost, from the newest committed checkpoint, resharded to the
new layout: the step counter and the sampler roll back with it, and the steps
after it are done again (work lost <= the checkpoint interval).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from elastic_rt.accelerator import use_worker_device
from elastic_rt.checkpoint import Checkpointer
from elastic_rt.config import DEFAULT_REFORM_TIMEOUT, ERROR_FILE_ENV, WorkerEnv
from elastic_rt.errors import (
    CheckpointError,
    ConfigError,
    ElasticError,
    FencedOutError,
    NewerRound,
    RendezvousClosedError,
    RoundAbandoned,
    StoreError,
    UserCodeError,
)
from elastic_rt.events import EventSink
from elastic_rt.layout import ModelLimits, plan_layout
from elastic_rt.worker.membership import RoundFollower
from elastic_rt.worker.round_store import join_round_store, wait_for_ranks
from elastic_rt.process_groups import Groups, abandon_groups, destroy_groups, init_groups
from elastic_rt.rendezvous.checkpoint_pointer import FencedPointer
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.root_cause import write_error_file
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.abort import round_notice
from elastic_rt.worker.allocator import (
    REPLICATED_TRIM_THRESHOLD_BYTES,
    SHARDED_TRIM_THRESHOLD_BYTES,
    HeapTrimmer,
    pin_heap,
)
from elastic_rt.worker.batches import BatchSource, LoaderOptions, MapDataset, check_dataset
from elastic_rt.worker.failures import user_code
from elastic_rt.worker.grad_sync import GradSync
from elastic_rt.worker.hang import HangWatchdog, dump_stacks
from elastic_rt.worker.progress import ProgressPublisher, StepClock
from elastic_rt.worker.sharded_trainer import ShardedTrainer
from elastic_rt.worker.replicated import StepFn, StepOptions
from elastic_rt.worker.trainers import (
    BuildFn,
    OwnedStepTrainer,
    Progress,
    ReplicatedTrainer,
    Restoring,
    Trainer,
)
from elastic_rt.worker.context import Context, set_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepReport:
    """What an ``on_step`` callback receives after every committed step."""

    step: int
    loss: float
    """The mean loss over the whole global batch (all data-parallel ranks)."""
    local_loss: float
    """The mean loss over this rank's samples."""
    world_size: int
    round: int


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
            only with ``step`` (an object owning its step splits its own share).
        limits: what the model allows; the layout is planned from it every round.
        max_failed_steps: the same step failing this often is raised, not retried.
        reform_timeout: the most to wait for a round that includes this node.
        collate: turns a micro-batch's samples into a batch (``loader`` overrides it).
        loader: ``DataLoader`` settings (worker processes, prefetch, pinned memory).
        grad_sync: gradient bucket sizes and the reduction hook.
        autocast_dtype: run ``step`` under autocast (float16 adds a GradScaler).
        clip_grad_norm: clip the averaged gradients to this global norm.
        on_step: called after every committed step with a :class:`StepReport`
            (costs one small all-reduce per step for the global loss).
        peer_copy_every: under FSDP (``limits.max_shard > 1``, no replica), snapshot each
            rank's shards and copy them to a rank on the next node every this many steps,
            so a node loss redoes at most this many steps without reading storage (0: off;
            see ``worker/peer_copies.py``).

    Raises:
        ElasticError: recovery is impossible (budget spent, no round in time).
        ConfigError: bad arguments (one clear line).
        UserCodeError: the user's code raised; the job was ended on every node.
    """
    if max_steps < 0 or global_batch_size < 1:
        raise ConfigError(
            f"max_steps={max_steps}, global_batch_size={global_batch_size}",
            "Pass max_steps >= 0 and global_batch_size >= 1.",
        )
    if step is None and micro_batch_size is not None:
        raise ConfigError(
            "micro_batch_size is set but build() owns its step (step=None)",
            "Split micro-batches inside the object's step(), or pass a step function.",
        )
    if step is None and (autocast_dtype is not None or clip_grad_norm is not None):
        raise ConfigError(
            "autocast_dtype or clip_grad_norm is set but build() owns its step (step=None)",
            "Apply autocast and clipping inside the object's step(), or pass a step function.",
        )
    if step is not None and limits.max_shard > 1 and (micro_batch_size or autocast_dtype):
        # FSDP needs every rank to run the same number of forwards (their all-gathers), and
        # mixed precision is its own MixedPrecisionPolicy: neither is wired in yet.
        raise ConfigError(
            "micro_batch_size or autocast_dtype is set with a sharded layout (max_shard > 1)",
            "Leave both unset with max_shard > 1, or train replicated (max_shard=1).",
        )
    check_dataset(dataset)
    # A steady heap over a long run; under FSDP one that keeps a step's gathered parameters
    # and gradients for the next step instead of trimming them (worker/allocator.py).
    is_sharded = step is not None and limits.max_shard > 1
    pin_heap(trim_threshold_bytes=SHARDED_TRIM_THRESHOLD_BYTES if is_sharded
             else REPLICATED_TRIM_THRESHOLD_BYTES)
    sampler = ElasticSampler(len(dataset), global_batch_size=global_batch_size, seed=seed,
                             micro_batch_size=micro_batch_size)
    options = StepOptions(grad_sync=grad_sync, autocast_dtype=autocast_dtype,
                          clip_grad_norm=clip_grad_norm)
    trainer: Trainer = (OwnedStepTrainer(build) if step is None
                        else ShardedTrainer(build, step, options, copy_every=peer_copy_every)
                        if limits.max_shard > 1
                        else ReplicatedTrainer(build, step, options))
    loop = _ElasticLoop(
        trainer=trainer, checkpoint=checkpoint, limits=limits, sampler=sampler,
        batches=BatchSource(dataset, sampler, loader or LoaderOptions(collate_fn=collate)),
        max_failed_steps=max_failed_steps, reform_timeout=reform_timeout, seed=seed,
        on_step=on_step, trim_heap=not is_sharded,
    )  # fmt: skip
    return loop.run(max_steps)


class _ElasticLoop:
    def __init__(self, *, trainer: Trainer, checkpoint: Checkpointer | None,
                 limits: ModelLimits, sampler: ElasticSampler, batches: BatchSource,
                 max_failed_steps: int, reform_timeout: timedelta, seed: int,
                 on_step: Callable[[StepReport], None] | None, trim_heap: bool) -> None:
        self.trainer = trainer
        self.checkpoint, self.limits, self.sampler = checkpoint, limits, sampler
        self.batches, self.on_step = batches, on_step
        self.max_failed_steps, self.reform_timeout = max_failed_steps, reform_timeout
        self.seed = seed
        self.env = WorkerEnv.from_env()
        use_worker_device(self.env.local_rank)  # cuda:LOCAL_RANK is current before build runs
        self.events = EventSink(self.env.events_file, source="worker", run_id=self.env.run_id,
                                node=self.env.node_id, rank=self.env.rank)
        # The follower's watch is the abort notice too: a newer round that drops a peer
        # cuts short any collective we wait on (worker/abort.py).
        self.follower = (RoundFollower(self.env, on_round=round_notice().observe)
                         if self.env.is_elastic else None)
        if self.follower is not None:
            # Building an optimizer imports torch._dynamo (1.5 s and more); do it before we
            # tell the agent we are ready, so that no round waits on it.
            import torch._dynamo  # noqa: F401

            # Tell the agent at once that we recover in-process, so that a round formed
            # while we are still starting does not make it restart us.
            self.follower.announce()
        self.collective_timeout = _collective_timeout(self.env)
        self.groups: Groups | None = None
        self.ctx: Context | None = None
        self.store: dist.Store | None = None
        self.progress = Progress()
        self.clock = StepClock()
        self.heap = HeapTrimmer() if trim_heap else None
        self.watchdog = HangWatchdog(self.clock, self.env.hang_factor, self._report_stall)
        self.publisher = ProgressPublisher(self.follower.registry) if self.follower else None
        if checkpoint is not None and self.follower is not None:
            checkpoint.bind(
                pointer=FencedPointer(self.follower.registry, checkpoint.url, self._token),
                events=self.events,
                collective_timeout=self.collective_timeout,
                round_of=lambda: self.ctx.round if self.ctx else None,
            )

    def _token(self) -> int:
        return self.ctx.token if self.ctx else self.env.token

    # the loop -------------------------------------------------------------------
    def run(self, max_steps: int) -> Any:
        round_ = self.follower.current() if self.follower else None
        try:
            while True:
                try:
                    self.reform_groups(round_)
                    self.restore()
                    self.resplit()
                    self.train(max_steps)
                    break
                except NewerRound:
                    logger.info("newer round pending; re-forming at step %d", self.progress.step)
                except UserCodeError as exc:
                    if self.follower is None:
                        raise
                    self.end_job(exc)
                    raise SystemExit(1) from None  # the job is over; its traceback is out
                except (RoundAbandoned, RuntimeError, dist.DistError) as exc:
                    # RuntimeError, DistError: torch's own for a failed collective.
                    self._release_groups(abandon=True)  # first: on_failure may raise
                    self.on_failure(round_, exc)
                if self.follower is None:
                    raise ElasticError(
                        "a collective failed outside elastic-rt launch; cannot recover")
                try:
                    round_ = self.wait_for_round(round_)
                except RendezvousClosedError as exc:
                    logger.error("%s", exc)  # its root cause is the agents' and the failed rank's
                    raise SystemExit(1) from None
            self._finish_checkpoint()
        finally:
            self.shutdown()
        return self.trainer.result()

    def train(self, max_steps: int) -> None:
        self.clock.resume(time.monotonic())
        self.watchdog.arm()
        try:
            self._train(max_steps)
        finally:
            self.watchdog.disarm()
        self._publish_progress(force=True)

    def _train(self, max_steps: int) -> None:
        while self.progress.step < max_steps:
            if self.follower and self.ctx and self.follower.has_newer_round(self.ctx.round):
                raise NewerRound()
            self.progress.is_dirty = not self.trainer.is_step_atomic()
            self._set_step(self.progress.step + 1)
            local_loss, contribution = self.train_step()
            global_loss = self._global_loss(contribution) if self.on_step else None
            self.sampler.advance()
            self.progress.step += 1
            self.progress.is_dirty = False
            self.progress.failed_attempts = 0
            self.clock.completed(time.monotonic())
            self._after_step(local_loss, global_loss)

    # recovery phases --------------------------------------------------------------
    def reform_groups(self, round_: Round | None) -> None:
        began = time.monotonic()
        # A save in flight uses this round's groups: let it finish (or fail) on every rank
        # first. Else it breaks on some ranks only, and their next save() raises that error
        # before the save's first collective, leaving the other ranks waiting in it.
        self._finish_checkpoint()
        self._release_groups()
        released = time.monotonic()
        rank, world, token, number = self._place(round_)
        self.events.rank = rank  # events carry this round's rank, not the first round's
        layout = plan_layout(world, self.limits)
        address = (
            self.follower.store_address(round_, self.reform_timeout)
            if self.follower and round_ and round_.number != self.env.round
            else (self.env.master_addr, self.env.master_port)
        )
        if address is None:
            raise NewerRound()  # the round's first node died before publishing its store
        newer = ((lambda: self.follower.has_newer_round(number))  # type: ignore[union-attr]
                 if self.follower is not None else None)
        self.store = None  # drop the previous round's store (its server closes with it)
        self.store = join_round_store(address, rank=rank, world_size=world,
                                      timeout=self.reform_timeout, newer_round=newer)
        joined = time.monotonic()
        prefix = f"/elastic_rt/{self.env.run_id}/round-{number}/"
        wait_for_ranks(self.store, prefix, world_size=world, timeout=self.reform_timeout,
                       newer_round=newer)
        round_notice().train_in(round_)
        all_in = time.monotonic()
        self.groups = init_groups(self.store, rank=rank, world_size=world, layout=layout,
                                  prefix=prefix, timeout=self.collective_timeout,
                                  join_timeout=max(self.collective_timeout, self.reform_timeout))
        self.ctx = Context(rank=rank, world_size=world, local_rank=self.env.local_rank,
                           node_id=self.env.node_id, round=number, token=token, layout=layout,
                           groups=self.groups)
        set_context(self.ctx)
        self.events.rank = rank  # events carry the rank of the round they happen in
        if self.follower and round_:
            self.follower.acknowledge(round_)
        if self.publisher is not None and rank == 0:
            value = {"round": number, "layout": layout.to_dict()}
            self.publisher.commit("layout", json.dumps(value), token)
        # Where the time went: the previous round's teardown, finding the store (address and
        # connect), waiting for the slowest rank, and building the groups (gloo's mesh).
        self._phase("groups.reformed", began, world_size=world, layout=str(layout),
                    release_ms=_ms(released - began), store_ms=_ms(joined - released),
                    ranks_ms=_ms(all_in - joined), groups_ms=_ms(time.monotonic() - all_in))

    def restore(self) -> None:
        began = time.monotonic()
        assert self.ctx is not None
        source = self.trainer.restore(Restoring(ctx=self.ctx, checkpoint=self.checkpoint,
                                                sampler=self.sampler, progress=self.progress))
        self._phase("state.restored", began, source=source)

    def resplit(self) -> None:
        assert self.ctx is not None
        self.sampler.set_world(self.ctx.dp_rank, self.ctx.dp_size)
        self.batches.reset()  # batches prefetched for the old split are dropped

    def on_failure(self, round_: Round | None, exc: BaseException) -> None:
        self.progress.failed_attempts += 1
        self.progress.failed_at = time.monotonic()
        logger.warning("step %d failed in round %s: %s", self.progress.step + 1,
                       round_.number if round_ else "-",
                       str(exc).splitlines()[0] if str(exc) else exc)
        self.events.emit("step.retried", round=round_.number if round_ else None,
                         step=self.progress.step + 1, error=type(exc).__name__,
                         attempt=self.progress.failed_attempts)
        if self.progress.failed_attempts >= self.max_failed_steps:
            raise ElasticError(
                f"step {self.progress.step + 1} failed {self.progress.failed_attempts} times"
            ) from exc
        if self.follower and round_:
            self.follower.report_failure(round_)

    def end_job(self, exc: UserCodeError) -> None:
        """The user's code raised: stop the job on every node instead of retrying it.

        The error file and the one-line root cause go out first: closing the run makes
        every agent stop its workers (this one too) and exit non-zero with that root
        cause; peers blocked in a collective with us fail, find the run closed and stop.
        Our agent prints the traceback from the error file in its root-cause report, as
        torchrun's does from ``@record``'s; it is printed here only if no file took it.
        """
        assert self.follower is not None
        if not write_error_file(os.environ.get(ERROR_FILE_ENV, ""), exc.__cause__ or exc,
                                step=exc.step):
            logger.error("user code failed:", exc_info=exc.__cause__)
        logger.error("%s (an error in the user's code: the job ends, it is not retried)", exc)
        self.events.emit("step.failed", round=self.ctx.round if self.ctx else None,
                         step=exc.step, error=str(exc))
        try:
            self.follower.registry.close(f"failed: {exc}")
        except StoreError as store_exc:
            logger.warning("could not close the run: %s", store_exc)

    def wait_for_round(self, round_: Round | None) -> Round:
        assert self.follower is not None and round_ is not None
        began = time.monotonic()
        new_round = self.follower.wait_for_round(round_.number, self.reform_timeout)
        self._phase("round.formed", began, round=new_round.number, world_size=new_round.world_size)
        return new_round

    # one training step ------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """(this rank's mean loss, its part of the global-batch mean) of one step."""
        assert self.ctx is not None
        step = self.progress.step + 1
        # Seeded per step, not per process: a retried or re-split step draws the same numbers.
        torch.manual_seed(self.seed * 1_000_003 + step)
        with user_code(rank=self.ctx.rank, step=step):
            micro_batches = self.batches.next_step()
        return self.trainer.train(micro_batches, global_len=len(self.sampler.global_batch()),
                                  ctx=self.ctx, step=step)

    def _global_loss(self, contribution: float) -> float:
        """The global-batch mean loss: the sum of every data-parallel rank's part."""
        assert self.groups is not None
        total = torch.tensor([contribution], dtype=torch.float64)
        if dist.get_world_size(self.groups.dp) > 1:
            work = dist.all_reduce(total, group=self.groups.dp, async_op=True)
            assert work is not None  # async_op=True always returns a Work
            round_notice().wait(work.get_future())
        return float(total)

    def _set_step(self, step: int) -> None:
        """Publish the step being trained through :func:`elastic_rt.context`."""
        assert self.ctx is not None
        self.ctx = dataclasses.replace(self.ctx, step=step)
        set_context(self.ctx)

    def _after_step(self, loss: float, global_loss: float | None) -> None:
        assert self.ctx is not None
        step = self.progress.step
        if self.progress.failed_at is not None:
            downtime = time.monotonic() - self.progress.failed_at
            self.events.emit("step.resumed", round=self.ctx.round, step=step,
                             downtime_ms=int(downtime * 1000), world_size=self.ctx.world_size)
            self.progress.failed_at = None
        if self.heap is not None:
            self.heap.after_step()
        self._publish_progress()
        extra = {} if global_loss is None else {"global_loss": global_loss}
        self.events.emit("step.completed", round=self.ctx.round, step=step,
                         loss=None if math.isnan(loss) else loss,
                         world_size=self.ctx.world_size, **extra)
        if self.on_step is not None and global_loss is not None:
            self.on_step(StepReport(step=step, loss=global_loss, local_loss=loss,
                                    world_size=self.ctx.world_size, round=self.ctx.round))
        if self.checkpoint is not None and self.checkpoint.should_save(step):
            assert self.groups is not None
            try:
                self.checkpoint.save(
                    step, self.trainer.checkpoint_state(), layout=self.ctx.layout.to_dict(),
                    extra={"step": step, "sampler": self.sampler.state_dict(),
                           **self.trainer.checkpoint_extra()},
                    process_group=self.groups.world,
                )  # fmt: skip
            except (FencedOutError, CheckpointError) as exc:
                # The previous save did not commit; the one before it stays the latest.
                logger.warning("checkpoint before step %d not committed: %s", step, exc)
            # A save is not a step: its time neither makes the next step look slow nor,
            # when it is long, a hang (a save that never returns is still reported).
            self.clock.resume(time.monotonic())

    def _publish_progress(self, *, force: bool = False) -> None:
        """Rank 0 keeps the run's ``progress`` key current for ``elastic-rt status``."""
        if self.publisher is not None and self.ctx is not None and self.ctx.rank == 0:
            self.publisher.publish(step=self.progress.step, round_=self.ctx.round,
                                   token=self.ctx.token, clock=self.clock, force=force)

    def _report_stall(self, stalled_s: float, threshold_s: float) -> None:
        """From the watchdog thread: name this rank, then dump its stacks into the log.

        Not while a newer round is pending: a lost peer explains the wait, and the
        re-form it leads to is reported by its own events.
        """
        ctx, follower = self.ctx, self.follower
        if ctx is not None and follower is not None and follower.has_newer_round(ctx.round):
            return
        rank = ctx.rank if ctx else self.env.rank
        logger.error("hang: rank %d on %s completed no step for %.1f s (over %.1f s, %g x the "
                     "median step time); its Python stacks follow", rank, self.env.node_id,
                     stalled_s, threshold_s, self.env.hang_factor)
        self.events.emit("step.stalled", round=ctx.round if ctx else None,
                         step=self.progress.step, stalled_s=round(stalled_s, 1),
                         threshold_s=round(threshold_s, 2))
        dump_stacks()

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
        """Destroy this round's groups and drop every reference to them, at once.

        A peer blocked receiving from us is only freed when our sockets close, and
        gloo closes them when the last reference to the group goes; a context still
        holding the groups kept a survivor's peers waiting out their full timeout.
        A round that failed (a collective raised, or the abort notice cut a wait short)
        is abandoned instead (``abandon``): a collective of ours may still be blocked on
        a peer, and destroying the groups would wait for it (``abandon_groups``); its
        peers are freed by the same notice, not by our sockets closing.
        """
        self.ctx = None
        set_context(None)
        self.trainer.release()  # e.g. gradient buckets hold the group
        if abandon:
            abandon_groups(self.groups)
        else:
            destroy_groups(self.groups)
        self.groups = None

    def _place(self, round_: Round | None) -> tuple[int, int, int, int]:
        """(rank, world size, token, round number) of this worker in ``round_``."""
        if round_ is None:
            return self.env.rank, self.env.world_size, self.env.token, self.env.round
        rank = round_.rank_offset(self.env.node_id) + self.env.local_rank
        return rank, round_.world_size, round_.token, round_.number

    def _phase(self, name: str, began: float, *, round: int | None = None,
               **metadata: Any) -> None:
        """Emit ``name`` with its duration; ``round`` defaults to the current one."""
        if round is None and self.ctx is not None:
            round = self.ctx.round
        now = time.monotonic()
        self.events.emit(name, round=round, step=self.progress.step,
                         duration_ms=int((now - began) * 1000), **metadata)

    def shutdown(self) -> None:
        # context() keeps describing the last round, so the script can tell its final rank.
        self.watchdog.close()
        self.batches.close()
        self.trainer.release()
        destroy_groups(self.groups)
        self.groups = None
        self.store = None
        if self.publisher is not None:
            self.publisher.close()  # before the follower's client, which it writes through
        if self.follower:
            self.follower.close()


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _collective_timeout(env: WorkerEnv) -> timedelta:
    """How long a training collective may wait for a peer: the lease TTL by default.

    A hung peer keeps its sockets open. The agents' heartbeats evict it in under a
    second and the new round's notice frees the runtime's own collectives (gradient
    averaging, state broadcast: ``worker/abort.py``), whatever this timeout; it is the
    last resort for collectives outside them (an object owning its step on gloo). By
    the time it passes, the peer's lease (renewed last before it hung) has expired too.
    A merely slow peer costs a re-form round, not the job: the agents find every node
    answering and re-form the same members. Joining a round has its own, longer
    timeout (a new node may still be starting). Override with
    ``ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC`` (600, as NCCL users set it, is tested).
    """
    return env.collective_timeout or env.lease_ttl
