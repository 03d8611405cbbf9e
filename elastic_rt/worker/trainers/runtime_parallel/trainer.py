"""The runtime-parallel family: pipeline and tensor parallelism built from one description.

``run(build=..., step=None, model_parallel=ModelParallel(...))`` picks it; ``build(layout)``
returns a :class:`ModelDescription`. Every round the runtime builds the model anew for the
round's layout (a stage and a DTensor are bound to their round's groups)::

    build(layout)            -> ModelDescription (the whole model, plain torch)
    rank_modules             -> this rank's stages, blocks cut by parameter count, full names
    split_tensors            -> block_tp_plan applied on the round's tp mesh
    shard_stages             -> fully_shard over dp (shard > 1): blocks, then stage roots
    description.optimizer    -> the optimizer over this rank's (DTensor) parameters
    restore                  -> by name, from survivors | checkpoint | init
    Pipeline                 -> PipelineStages on the pp group + the named schedule

and its state comes, in this order of preference, from

1. the ranks that hold every ``(pp, tp)`` part of one cut cleanly at one step, whatever
   the new cut (``by_name``: each tensor to its new owner): 0 steps lost;
2. the same, a lost part taken from the snapshot its ring holder keeps in host memory
   (``copies``, every ``copy_every`` steps where a part has no replica on another node;
   ``copy_sources`` chooses): at most ``copy_every`` steps done again, no storage read;
3. the newest committed checkpoint, loaded by name into the new cut (steps after it are
   done again);
4. the description as built (a fresh start only; ``build`` must be seeded, so that every
   rank builds the same model).

A step is atomic: the pipeline's sends and receives, the loss broadcast and the gradient
all-reduce over the dp group (FSDP's reduce-scatter in backward when sharded) all come
before the optimizer step, so a step that raised leaves every rank's state at the last
committed step.

``autocast_dtype`` (bfloat16) is FSDP's mixed precision in a sharded round and autocast in
an unsharded one (``precision.py``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from elastic_rt.errors import ConfigError
from elastic_rt.layout import Layout
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.batches import to_device
from elastic_rt.worker.context import Context
from elastic_rt.worker.failures import user_code
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.checkpoint_restore import (
    from_checkpoint_or_init,
    load_checkpoint_into,
    named_state,
)
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.protocol import BuildFn, Restored, Restoring
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state
from elastic_rt.worker.trainers.runtime_parallel.by_name import (
    Offer,
    fetch_offers,
    flatten,
    offer_of,
)
from elastic_rt.worker.trainers.runtime_parallel.clipping import clip_grad_norm
from elastic_rt.worker.trainers.runtime_parallel.copies import PartCopies, named_part
from elastic_rt.worker.trainers.runtime_parallel.copy_sources import Choice, gather, pick_sources
from elastic_rt.worker.trainers.runtime_parallel.description import ModelDescription
from elastic_rt.worker.trainers.runtime_parallel.grads import settle_partial, sum_gradients
from elastic_rt.worker.trainers.runtime_parallel.precision import autocast, fsdp_policy
from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel, Pipeline
from elastic_rt.worker.trainers.runtime_parallel.sharding import (
    holder_of,
    keep_gathered,
    reduce_on,
    shard_stages,
)
from elastic_rt.worker.trainers.runtime_parallel.stages import (
    RankModules,
    device_of,
    local_params,
    rank_modules,
    split_tensors,
)
from elastic_rt.worker.trainers.runtime_step import initialize_optimizer_state

logger = logging.getLogger(__name__)

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class RuntimeParallelTrainer:
    """This rank's stages of a described model, rebuilt and restored every round.

    Args:
        autocast_dtype: compute in this dtype (bfloat16; see the module's docstring).
        accumulates: a step may bring several micro-batches (``micro_batch_size`` is
            set): under FSDP at ``pp == 1`` each runs its own forward and backward.
    """

    def __init__(self, build: BuildFn, options: ModelParallel, *, copy_every: int = 1,
                 clip_grad_norm: float | None = None, autocast_dtype: torch.dtype | None = None,
                 accumulates: bool = False) -> None:
        self.build, self.options, self.clip_grad_norm = build, options, clip_grad_norm
        self.autocast_dtype, self.accumulates = autocast_dtype, accumulates
        self.copies = PartCopies(copy_every)
        self.sampler: ElasticSampler | None = None
        self.description: ModelDescription | None = None
        self.modules: RankModules | None = None
        self.state: TrainState | None = None
        self.held: tuple[Layout, int] | None = None  # (layout, rank) the state is cut by
        self.ahead = False  # the state holds the update of a step whose copies never landed
        self.pipeline: Pipeline | None = None
        self._losses: list[tuple[float, int]] = []  # this step's (micro-batch loss, samples)
        self._global_len = 1

    def result(self) -> Any:
        """The rank's :class:`TrainState`: its stages' parts, under the full model's names."""
        return self.state

    def prepare(self, layout: Layout) -> bool:
        """Nothing ahead of the round: the tensor split takes the round's mesh."""
        return False

    def restore(self, at: Restoring) -> Restored:
        self.copies.stop()
        kept = (self.description, self.modules, self.state, self.held, self.ahead,
                self.copies.snapshots, at.progress.step, at.progress.is_dirty,
                at.sampler.state_dict())
        try:
            return Restored(self._restore(at))
        except BaseException:
            # A peer died during the restore: keep what this rank held, so that the next
            # round can still restore from it (a fresh build holds nothing).
            self.copies.stop()  # made for the new state, which is dropped
            (self.description, self.modules, self.state, self.held, self.ahead,
             self.copies.snapshots, at.progress.step, at.progress.is_dirty, sampler) = kept
            at.sampler.load_state_dict(sampler)
            raise

    def _restore(self, at: Restoring) -> str:
        ctx, progress = at.ctx, at.progress
        old, held = self.state, self.held
        mine = holder_of(step=progress.step, is_clean=not (progress.is_dirty or self.ahead),
                         layout=held[0] if held else None, rank=held[1] if held else None)
        holders, copies = gather(mine, self.copies.held(), ctx.groups.world)
        progress.is_dirty = True  # until the new state holds the state of `step`
        self.sampler = at.sampler
        state = self._build(ctx)
        last = max(h.last_step for h in holders)
        # never a step nobody committed: one whose copies were still landing when it failed
        choice = pick_sources(holders, copies, newest=last)
        if choice is None:
            source = from_checkpoint_or_init(at, lambda: load_checkpoint_into(state, at),
                                             state=state, last=last)
        else:
            source = self._from_survivors(at, old, state, choice)
            if last > choice.step:
                logger.warning("restored from %s of step %d; steps %d-%d are done again",
                               source, choice.step, choice.step + 1, last)
        self.copies.clear()  # taken again under the new cut, from the restored state on
        self._start_pipeline(ctx)
        self.copies.start(ctx)
        self.copies.refresh(ctx, progress.step, state, at.sampler)
        self.copies.commit(ctx, progress.step)  # the restored state's copies, landed
        return source

    def _from_survivors(self, at: Restoring, old: TrainState | None, state: TrainState,
                        choice: Choice) -> str:
        """Every tensor of ``state`` by name from the parts' sources, which read ``old``
        (their state of the previous round) or a snapshot; the record beside it from the
        first."""
        ctx = at.ctx
        initialize_optimizer_state(state.optimizer)  # the transfer writes into its tensors
        flat = flatten(named_state(state))
        offers, record = self._offers(at, old, choice)
        fetch_offers(offers, flat, ctx.groups.world)
        _load(state, flat)
        first = min(choice.ranks.values())
        meta, is_fresh = broadcast_state(record if ctx.rank == first else None, first,
                                         ctx.groups.world)
        if is_fresh:  # the sources' optimizer had taken no step: neither has this one
            state.optimizer.state.clear()
        at.take(TrainMeta.decode(meta), state)
        at.progress.step, at.progress.is_dirty = choice.step, False
        return "survivors" if len(choice.live) == len(choice.ranks) else "peer copies"

    def _offers(self, at: Restoring, old: TrainState | None,
                choice: Choice) -> tuple[list[Offer], tuple[dict[str, Any], bool] | None]:
        """What this rank sends from (its live state, snapshots), and the record beside
        with whether the optimizer had taken no step (``copies.named_part``)."""
        offers: list[Offer] = []
        record: tuple[dict[str, Any], bool] | None = None
        mine = sorted(part for part, rank in choice.ranks.items() if rank == at.ctx.rank)
        if old is not None and any(part in choice.live for part in mine):
            flat, is_fresh = named_part(old)
            offers.append(offer_of(flat))  # a rank lives one part
            record = at.meta(old, step=choice.step).encode(), is_fresh
        for part in (p for p in mine if p not in choice.live):
            offer, meta, is_fresh = self.copies.offer(choice.step, part)
            offers.append(offer)
            record = record or (meta, is_fresh)
        return offers, record

    def _build(self, ctx: Context) -> TrainState:
        """The description for the round's layout, cut, tensor-split, with its optimizer."""
        self.state = self.description = self.modules = self.pipeline = None
        self.ahead = False
        described = self.build(ctx.layout)
        if not isinstance(described, ModelDescription):
            raise ConfigError(f"build() returned {type(described).__name__} with "
                              "model_parallel= set", "Return elastic_rt.ModelDescription(...).")
        modules = rank_modules(described, ctx.layout, ctx.rank,
                               stages_per_rank=self.options.stages_per_rank)
        tp_mesh = ctx.groups.mesh["tp"] if ctx.groups.mesh is not None else None
        split_tensors(described, modules, tp_mesh)
        if ctx.layout.shard > 1:
            assert ctx.groups.shard_mesh is not None  # made by init_groups for shard > 1
            shard_stages(described, modules, ctx.groups.shard_mesh,
                         policy=fsdp_policy(self.autocast_dtype))
            if self.accumulates and ctx.layout.pp == 1:  # a schedule keeps its own
                keep_gathered(modules.stages)
        state = TrainState(model=modules.local, optimizer=described.optimizer(
            local_params(modules)))
        self.description, self.modules, self.state = described, modules, state
        self.held = (ctx.layout, ctx.rank)
        return state

    def _start_pipeline(self, ctx: Context) -> None:
        if ctx.layout.pp == 1:
            return
        assert self.modules is not None
        self.pipeline = Pipeline(self.options, self.modules, ctx.groups.pp,
                                 device_of(self.modules), self._loss)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The user's mean loss of a micro-batch, weighted by its share of the global batch."""
        assert self.description is not None
        loss = self.description.loss(output, target)
        size = int(target.shape[0])
        self._losses.append((float(loss.detach()), size))
        return loss * (size / self._global_len)

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.state is not None and self.modules is not None
        self._losses, self._global_len = [], global_len
        assert self.sampler is not None
        self.copies.settle()  # the previous copy's send, before the step changes the state
        self.state.optimizer.zero_grad(set_to_none=True)
        samples = sum(size for _, size in micro_batches)
        if not samples and ctx.layout.shard > 1:
            # every rank of a sharded part must run forward and backward (their collectives)
            raise ConfigError(f"step {step}: the global batch of {global_len} leaves rank "
                              f"{ctx.rank} of {ctx.layout.dp} data-parallel ranks without samples",
                              "Use a global batch of a multiple of the data-parallel size.")
        device = device_of(self.modules)
        micro_batches = [(to_device(batch, device), size) for batch, size in micro_batches]
        with user_code(rank=ctx.rank, step=step):
            if samples and self.pipeline is not None:
                inputs, target = _joined(micro_batches)
                n = self.options.microbatches(loop_count=len(micro_batches), samples=samples,
                                              stages=self.modules.num_stages,
                                              pp=ctx.layout.pp)
                # the schedule runs forward and backward in one call
                with autocast(self.autocast_dtype, ctx.layout, device.type):
                    self.pipeline.step(inputs, target, n)
                # a new schedule's first step calls the loss once more, before the
                # micro-batches, to infer the gradients' shapes (torch 2.13): not a loss
                self._losses = self._losses[-n:] if self.pipeline.has_last else []
            elif samples:
                self._backward_each(micro_batches, ctx.layout, device)
        loss_sum = self._loss_sum(ctx)
        if ctx.layout.shard == 1:  # else FSDP reduced them in backward
            settle_partial(local_params(self.modules))
            sum_gradients(local_params(self.modules), ctx.groups.dp)
        if self.clip_grad_norm is not None:
            clip_grad_norm(local_params(self.modules), self.clip_grad_norm, ctx.layout,
                           ctx.groups.world)
        self.state.optimizer.step()  # after every collective of the step
        self.copies.refresh(ctx, step, self.state, self.sampler.advanced())  # never waits
        try:
            self.copies.commit(ctx, step)  # with copies, the step counts once they landed
        except BaseException:
            self.ahead = True  # the update of a step that never counted
            raise
        return (loss_sum / samples if samples else math.nan), loss_sum / global_len

    def _backward_each(self, micro_batches: list[tuple[Any, int]], layout: Layout,
                       device: torch.device) -> None:
        """A forward and backward per micro-batch (``pp == 1``); under FSDP only the last
        backward reduces (``sharding.reduce_on``: the counts may differ between ranks)."""
        assert self.modules is not None
        for i, (batch, _) in enumerate(micro_batches):
            if layout.shard > 1:
                reduce_on(self.modules.stages, is_last_backward=i == len(micro_batches) - 1)
            with autocast(self.autocast_dtype, layout, device.type):
                loss = self._loss(_forward(self.modules, batch[0]), batch[1])
            loss.backward()

    def _loss_sum(self, ctx: Context) -> float:
        """The summed loss of this rank's samples, known on every stage (the last one's)."""
        total = torch.tensor([sum(value * size for value, size in self._losses)],
                             dtype=torch.float64)
        if self.pipeline is not None:
            last = dist.get_global_rank(ctx.groups.pp, ctx.layout.pp - 1)
            dist.broadcast(total, src=last, group=ctx.groups.pp)
        return float(total)

    def is_step_atomic(self) -> bool:
        """A step changes nothing before its last collective. With copies it then waits
        for them to land (``copies.commit``), after its update: one that raises there marks
        the state :attr:`ahead`, and the restore takes the snapshots instead."""
        return True

    def compute_seconds(self) -> float | None:
        """None: the stages wait on each other inside the step."""
        return None

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state by the full model's names; DTensors where tp > 1."""
        assert self.state is not None
        return named_state(self.state)

    def checkpoint_meta(self, *, step: int, sampler: ElasticSampler) -> TrainMeta:
        return TrainMeta.capture(step=step, sampler=sampler, state=self.state)

    def hand_over(self, ctx: Context, step: int) -> None:
        """Copies of every part as of ``step`` (just committed), where copies are kept: a
        leaver's part then comes from its ring holder with nothing redone. Collective; the
        copies then stop for the round. Else its parts come from replicas or the checkpoint.
        """
        if self.state is not None and self.sampler is not None:  # unless the step sent it
            self.copies.refresh(ctx, step, self.state, self.sampler, force=True)
        self.copies.stop()

    def release(self) -> None:
        """The stages and schedules hold the round's pp group: they go with it."""
        self.copies.stop()
        self.pipeline = None


def _forward(modules: RankModules, inputs: Any) -> Any:
    """The rank's stages in order: each is an FSDP root when sharded, so it is called."""
    for stage in modules.stages:
        inputs = stage(inputs)
    return inputs


def _joined(micro_batches: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The share as one ``(inputs, target)`` pair (the schedule cuts its own micro-batches)."""
    batches = [batch for batch, _ in micro_batches]
    return (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))


def _load(state: TrainState, flat: dict[str, Any]) -> None:
    """Load the flat by-name state into ``state``'s model and optimizer."""
    model = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("model/")}
    optim = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("optimizer/")}
    set_state_dict(state.model, state.optimizer, model_state_dict=model,
                   optim_state_dict=optim, options=_FLAT)
