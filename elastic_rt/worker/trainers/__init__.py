"""What the loop trains: one :class:`Trainer` per worker, chosen once by :func:`choose`.

Rule: ``model_parallel`` given -> runtime parallel (``build`` returns a ``ModelDescription``);
``step=None`` -> model parallel (an object owning its step); ``limits.max_shard > 1`` ->
sharded; else replicated. The family is picked by an argument, not by what ``build``
returns: ``build`` first runs in a round, long after the family must be known.

Each family restores from the first source that has the state::

    family           trains                                restores from
    replicated       a TrainState on every dp rank         kept | replica_transfer | checkpoint
                                                           | init
    sharded/         a TrainState under FSDP2 / HSDP       row_fetch of live pieces | of
                                                           peer_copies | checkpoint | init
    model_parallel/  an object owning its step, pp x tp    part_broadcast | checkpoint | init
    runtime_parallel/ a ModelDescription the runtime cuts    by_name from survivors |
                     into pp stages, tp plans, dp replicas of copies | checkpoint | init
                     or FSDP / HSDP shards over dp

The replicated and sharded families train through ``runtime_step`` (the runtime's step).
Shared by all three: ``protocol`` (what the loop sees), ``meta`` (:class:`TrainMeta`, the one
record beside the tensors, one encoding for checkpoints and every restore) and
``checkpoint_restore`` (the one fall-back to the checkpoint or the initial state). Words: a
*shard* is only the FSDP axis (``sharded/``); a *part* is a model-parallel rank's ``(pp, tp)``
cut; a *piece* is what one rank holds of a sharded state. A new family is a module or folder
here plus one line in :func:`choose`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_rt.layout import ModelLimits
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.protocol import (
    BuildFn,
    Progress,
    Restoring,
    SteppedModel,
    Trainer,
)
from elastic_rt.worker.trainers.replicated import ReplicatedTrainer
from elastic_rt.worker.trainers.runtime_step import StepFn, StepOptions

if TYPE_CHECKING:
    from elastic_rt.worker.trainers.runtime_parallel.schedule import ModelParallel

__all__ = ["BuildFn", "Progress", "Restoring", "StepFn", "StepOptions", "SteppedModel",
           "TrainMeta", "Trainer", "choose"]


def choose(*, build: BuildFn, step: StepFn | None, limits: ModelLimits, options: StepOptions,
           peer_copy_every: int, model_parallel: ModelParallel | None = None) -> Trainer:
    """The trainer for ``run``'s arguments: the one place the family is decided.

    Raises:
        ConfigError: ``peer_copy_every`` is negative (sharded and runtime-parallel families).
    """
    # The other families are imported here, not above: FSDP and torch's pipelining (with
    # dynamo) would cost a data-parallel worker's start 0.6 s and 1.1 s it never uses
    # (scripts/bench/worker_import.py, this 2-core machine).
    if model_parallel is not None:
        from elastic_rt.worker.trainers.runtime_parallel.trainer import RuntimeParallelTrainer

        return RuntimeParallelTrainer(build, model_parallel, copy_every=peer_copy_every,
                                      clip_grad_norm=options.clip_grad_norm,
                                      autocast_dtype=options.autocast_dtype,
                                      accumulates=options.accumulates)
    if step is None:
        from elastic_rt.worker.trainers.model_parallel.trainer import OwnedStepTrainer

        return OwnedStepTrainer(build)
    if limits.max_shard > 1:
        from elastic_rt.worker.trainers.sharded.trainer import ShardedTrainer

        return ShardedTrainer(build, step, options, copy_every=peer_copy_every)
    return ReplicatedTrainer(build, step, options)
