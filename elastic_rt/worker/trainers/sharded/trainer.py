"""The sharded family: a user's ``TrainState`` under FSDP2 or HSDP, rebuilt per round.

``run(limits=ModelLimits(max_shard=...))`` picks it; ``build(layout)`` and ``step`` stay what
they are for data parallelism. Every round the planner may cut the state differently (fsdp4,
then fsdp3 after a node loss, hsdp2x2 after growth), and a sharded module is bound to its
round's mesh, so each round ``build`` makes a fresh model, the runtime shards it over the new
mesh, and the state comes, in this order of preference, from

1. the pieces the ranks hold (their own shards, a surviving HSDP replica's): 0 steps lost;
2. under FSDP, the snapshots ranks keep of their own pieces and of the pieces they hold
   copies of for ranks on other nodes (``peer_copies``, placed by ``copy_placement``,
   sent beside training; a copy counts once it has arrived whole): at most
   ``copy_every`` steps done again;
3. the newest committed checkpoint, resharded (steps after it are done again);
4. the initial state (rank 0's model, on a fresh start only).

A step updates the state only after its last collective (FSDP's reduce-scatter, clipping's
norm), so a step that raised because a peer died leaves every survivor's piece at the last
committed step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

from elastic_rt.errors import ConfigError
from elastic_rt.layout import Layout
from elastic_rt.process_groups import group_timeout, side_group
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.context import Context
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.checkpoint_restore import (
    from_checkpoint_or_init,
    load_checkpoint_into,
)
from elastic_rt.worker.trainers.copy_placement import copy_holders, gather_nodes, held_for
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.protocol import BuildFn, Restored, Restoring
from elastic_rt.worker.trainers.replica_broadcast import broadcast_state
from elastic_rt.worker.trainers.runtime_step import (
    ReplicatedStep,
    StepFn,
    StepOptions,
    initialize_optimizer_state,
)
from elastic_rt.worker.trainers.sharded.fsdp import (
    ShardedGradients,
    build_unfilled,
    load_whole,
    local_piece,
    materialize,
    put_shards_back,
    row_targets,
    shard_train_state,
)
from elastic_rt.worker.trainers.sharded.peer_copies import PeerCopies, Ring, Snapshot
from elastic_rt.worker.trainers.sharded.row_fetch import (
    Holding,
    fetch_rows,
    gather_holdings,
    pick_piece_sources,
)
from elastic_rt.worker.trainers.train_state_trainer import TrainStateTrainer

logger = logging.getLogger(__name__)


class ShardedTrainer(TrainStateTrainer):
    """A ``TrainState`` sharded over the data-parallel ranks (plain replicas when the round's
    layout has ``shard == 1``); the runtime does its step."""

    def __init__(self, build: BuildFn, step_fn: StepFn, options: StepOptions, *,
                 copy_every: int = 1) -> None:
        if copy_every < 0:
            raise ConfigError(f"peer_copy_every={copy_every} is negative",
                              "Pass 0 (no peer copies) or a number of steps >= 1.")
        self.build, self.step_fn, self.options = build, step_fn, options
        self.copy_every = copy_every
        self.state: TrainState | None = None
        self.stepper: ReplicatedStep | None = None
        self.held: tuple[Layout, int] | None = None  # (layout, rank) the state is cut by
        self.snapshots: list[Snapshot] = []  # the completed ones, once copies stop
        self.copies: PeerCopies | None = None  # this round's copies, under FSDP
        self.sampler: ElasticSampler | None = None

    def restore(self, at: Restoring) -> Restored:
        self._stop_copies()
        kept = (self.state, self.stepper, self.held, self.snapshots, at.progress.step,
                at.progress.is_dirty, at.sampler.state_dict())
        try:
            source = self._restore(at)
        except BaseException:
            # A peer died during the restore: keep what this rank held, so that the next
            # round can still restore from it (a fresh build holds nothing).
            if self.copies is not None:  # made for the new state, which is dropped
                self.copies.close()
                self.copies = None
            (self.state, self.stepper, self.held, self.snapshots, at.progress.step,
             at.progress.is_dirty, sampler) = kept
            at.sampler.load_state_dict(sampler)
            raise
        # The old state and snapshots go before the restored state's copy is made: its
        # buffer then takes their memory instead of adding to it (600 MB a rank at 1.2 GB).
        # A sharded module and its FSDP state refer to each other, so dropping the last
        # reference frees nothing until the cyclic collector runs: on one survivor of two
        # the old state and snapshots (1.5 GB at 1.2 GB) outlived the restore and the new
        # snapshot came on top. One collection here frees them at once.
        del kept
        gc.collect()
        self._refresh_snapshot(at.progress.step, at.sampler)  # the restored state's copy
        return Restored(source)

    def _restore(self, at: Restoring) -> str:
        ctx, progress = at.ctx, at.progress
        old, old_stepper, snapshots = self.state, self.stepper, self.snapshots
        self.sampler = at.sampler
        lives, copies, last = gather_holdings(
            self._holdings(progress.step, progress.is_dirty),
            [snapshot.holding() for snapshot in snapshots], progress.step,
            ctx.groups.world)
        sources = pick_piece_sources(lives)
        source = "replicas"
        if sources is None:
            sources = pick_piece_sources([a + b for a, b in zip(lives, copies)])
            source = "peer copies"
        progress.is_dirty = True  # until the new state holds the state of `step`
        self.state, self.stepper, self.held = (self._build(ctx, unfilled=sources is not None),
                                               None, (ctx.layout, ctx.rank))
        self.snapshots = []  # taken again under the new layout from the next step
        if sources is not None:
            live_step = progress.step

            def read(index: int) -> dict[str, Any]:
                assert old is not None and old_stepper is not None
                if sources.step == live_step and lives[ctx.rank][:1] == [
                        Holding(live_step, sources.count, index)]:
                    put_shards_back(old.model)  # the step that failed may be mid-forward
                    return {"piece": local_piece(old),
                            "meta": at.meta(old, old_stepper, step=live_step).encode()}
                snapshot = next(s for s in snapshots
                                if s.step == sources.step and s.index == index)
                return {"piece": snapshot.piece, "meta": snapshot.meta}
            self._shard(ctx)
            initialize_optimizer_state(self.state.optimizer)
            layout = ctx.layout
            wants = [(layout.shard, layout.shard_index(rank)) for rank in range(ctx.world_size)]
            whole, meta = fetch_rows(sources, read, ctx.groups.world, wants,
                                     row_targets(self.state))
            load_whole(self.state, whole)
            at.take(TrainMeta.decode(meta), self.state, self.stepper)
            if last > sources.step:
                logger.warning("restored from %s of step %d; steps %d-%d are done again",
                               source, sources.step, sources.step + 1, last)
            progress.step, progress.is_dirty = sources.step, False
            return source
        return self._from_checkpoint_or_init(at, last)

    def _refresh_snapshot(self, committed: int, sampler: ElasticSampler) -> None:
        """Every ``copy_every`` steps under FSDP: snapshot this rank's piece as step
        ``committed`` left it (``sampler`` as it is after that step) and send a copy to its
        holder in the background.

        Called as a step ends, once its update is applied: the copy leaves as soon as this
        rank is done and lands while slower ranks finish (a node killed between its last
        collective and the next step then costs no step). :meth:`train` settles the previous
        send before the step, so this never waits: a wait that failed here would fail a step
        whose update is applied."""
        copies = self.copies
        if copies is None or not copies.is_due(committed):
            return
        assert self.state is not None and self.stepper is not None
        meta = TrainMeta.capture(step=committed, sampler=sampler, state=self.state,
                                 stepper=self.stepper)
        copies.refresh(committed, local_piece(self.state), meta.encode())

    def hand_over(self, ctx: Context, step: int) -> None:
        """Under FSDP: copies of every piece as of the step just committed, on their holders.

        The leaver's piece then lives on its holder at that very step, and the
        members restore it from there with nothing redone (a copy made every k steps may
        be up to k - 1 old at the boundary; every step, the step sent it already).
        Collective: every rank refreshes, and closing waits for every copy to arrive; the
        copies then stop for the round. Without copies (``peer_copy_every=0``) the leaver's
        piece comes from the checkpoint.
        """
        copies = self.copies
        if copies is None:
            if ctx.layout.shard > 1 and ctx.layout.replicas == 1:
                logger.warning("a member leaves and no peer copies are kept "
                               "(peer_copy_every=0): its shards come from the checkpoint")
            return
        assert self.state is not None and self.stepper is not None and self.sampler is not None
        meta = TrainMeta.capture(step=step, sampler=self.sampler, state=self.state,
                                 stepper=self.stepper)
        copies.refresh(step, local_piece(self.state), meta.encode())  # unless sent already
        self._stop_copies()

    def _start_copies(self, ctx: Context) -> None:
        """This round's peer copies, on a group of its own (FSDP only; collective)."""
        layout = ctx.layout
        if not self.copy_every or layout.shard == 1 or layout.replicas > 1:
            return
        holders = copy_holders(gather_nodes(ctx.node_id, ctx.groups.world))
        if holders is None:  # one node: no copy would outlive it
            return
        # As long as a training collective waits (the world group waits longer, to join).
        group = side_group(ctx.groups.world, group_timeout(ctx.groups.dp))
        assert group is not None  # the round's groups exist
        sources = held_for(ctx.rank, holders)
        ring = Ring(to=holders[ctx.rank], sources=sources, count=layout.shard,
                    own_index=layout.shard_index(ctx.rank),
                    peer_indices=tuple(layout.shard_index(source) for source in sources))
        self.copies = PeerCopies(group, ring, every=self.copy_every)

    def _stop_copies(self) -> None:
        """End this round's copies; keep the snapshots and the copies that arrived."""
        if self.copies is not None:
            self.snapshots = self.copies.close()
            self.copies = None

    def _holdings(self, step: int, is_dirty: bool) -> list[Holding]:
        if self.held is None or is_dirty or step < 0:
            return []
        layout, rank = self.held
        return [Holding(step, layout.shard, layout.shard_index(rank))]

    def _build(self, ctx: Context, *, unfilled: bool = False) -> TrainState:
        """The round's fresh state; ``unfilled`` when the pieces will overwrite every value
        (:func:`fsdp.build_unfilled`: on the meta device where the build allows it, given
        memory once sharded)."""
        state = build_unfilled(lambda: self.build(ctx.layout)) if unfilled else None
        if state is None:
            state = self.build(ctx.layout)
        if not isinstance(state, TrainState):
            raise ConfigError(f"build() returned {type(state).__name__}",
                              "Return elastic_rt.TrainState(model=..., optimizer=...).")
        return state

    def _shard(self, ctx: Context) -> None:
        assert self.state is not None
        reducer = None
        options = self.options
        if ctx.layout.shard > 1:
            assert ctx.groups.shard_mesh is not None
            # FSDP's mixed precision instead of autocast (fsdp.shard_train_state)
            shard_train_state(self.state, ctx.groups.shard_mesh,
                              param_dtype=options.autocast_dtype)
            reducer = ShardedGradients(self.state.model, accumulates=options.accumulates)
            options = dataclasses.replace(options, autocast_dtype=None)
        materialize(self.state)  # after sharding (this rank's shards only), if built unfilled
        self.stepper = ReplicatedStep(self.state, self.step_fn, options)
        self.stepper.bind(ctx.groups.dp, reducer)
        self._start_copies(ctx)

    def _from_checkpoint_or_init(self, at: Restoring, last: int) -> str:
        state = self.state
        assert state is not None
        # Rank 0's build is everybody's start (a checkpoint then overwrites all of it).
        state.model.load_state_dict(broadcast_state(state.model.state_dict(), 0,
                                                    at.ctx.groups.world))
        self._shard(at.ctx)
        return from_checkpoint_or_init(at, lambda: load_checkpoint_into(state, at), state=state,
                                       stepper=self.stepper, last=last)

    def train(self, micro_batches: list[tuple[Any, int]], *, global_len: int, ctx: Context,
              step: int) -> tuple[float, float]:
        assert self.stepper is not None
        if not micro_batches and ctx.layout.shard > 1:
            # Every rank of a sharded model must run forward and backward (their collectives).
            raise ConfigError(
                f"step {step}: the global batch of {global_len} leaves rank {ctx.rank} of "
                f"{ctx.layout.dp} data-parallel ranks without samples",
                "Use a global batch of at least the largest data-parallel size, and "
                "drop_last-sized epochs.",
            )
        if self.copies is not None:
            self.copies.settle()  # the previous copy's send, before the step changes the state
        loss = self.stepper.run(micro_batches, global_len=global_len, rank=ctx.rank, step=step)
        assert self.sampler is not None
        self._refresh_snapshot(step, self.sampler.advanced())  # never waits (settled above)
        return loss.local_mean, loss.contribution

    def release(self) -> None:
        self._stop_copies()
        super().release()
