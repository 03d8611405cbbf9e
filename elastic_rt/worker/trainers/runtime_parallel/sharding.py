"""FSDP2 / HSDP over the data-parallel axis of a runtime-parallel layout (``shard > 1``).

Rule (torchtitan's order): the tensor-parallel plan first, then ``fully_shard`` on the
round's shard mesh (its ``"dp"`` axis, or ``("replicate", "shard")`` for HSDP; a slice of
the same root mesh as ``"tp"``, which FSDP2 needs to join the two): every block this rank
holds is one unit, then each stage is a root (the modules before and after the blocks go
with it). A tensor-parallel parameter becomes a DTensor on the 2-D (or 3-D) mesh; a
column-parallel one gets FSDP2's private ``_StridedShard`` placement on dp, which still
holds a box of the whole tensor (``by_name.local_box``), so state moves by name unchanged.

Gradients are *summed* over the shard (and replicate) ranks by FSDP's own reduce-scatter
(and all-reduce) during backward, with divide factor 1 as ``sharded/fsdp.py`` does: each
micro-batch's loss is already weighted by its share of the global batch. So the trainer
sums nothing over dp itself, and the step stays atomic: every collective comes before
the optimizer step.

Gradient accumulation at ``pp == 1`` (:func:`keep_gathered`, :func:`reduce_on`): one
forward and backward per micro-batch, reduced only in the last backward. Ranks of one
shard group may get different numbers of micro-batches (the sampler splits a global batch
of 8 over 3 ranks as 3, 3, 2; by 2, that is 2, 2 and 1 micro-batches), and FSDP's
collectives must match rank for rank, so the gathered parameters are kept from the step's
first forward to its last backward: every rank all-gathers once (first forward) and
reduce-scatters once (last backward), whatever its count, as ``sharded/fsdp.py``'s
``ShardedGradients`` does. The cost is each unit's unsharded parameters during the step, no
more than the unsharded gradients FSDP's unsynced backward keeps anyway. With ``pp > 1``
torch's ``PipelineStage`` does the same itself (``backward_maybe_with_nosync`` turns the
sync off for every micro-batch, ``perform_reduce_grad`` reduces once after the last; torch
2.13). A step that fails part-way leaves parameters gathered; a restore still reads the
shards (FSDP's state-dict hooks reshard first; tried: a forward left mid-step under
``fsdp2xtp2``, then survivors restored the state equal to one process).

Restore: a rank's *part* is its ``(pp, tp)`` cut and its shard index; :func:`holder_of`
counts each shard piece as a part of its own, so survivors restore only when every piece
of one cut has a clean holder.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.model_parallel.part_broadcast import Holder, Part
from elastic_rt.worker.trainers.runtime_parallel.description import ModelDescription
from elastic_rt.worker.trainers.runtime_parallel.stages import RankModules, StageModule


def shard_stages(description: ModelDescription, modules: RankModules, mesh: DeviceMesh, *,
                 policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> None:
    """``fully_shard`` this rank's blocks, then each of its stages, over ``mesh`` with
    ``policy`` (``precision.fsdp_policy``). Collective over the shard mesh's groups (FSDP2
    reads its ranks' coordinates only: no traffic)."""
    held = {id(m) for m in modules.local.modules()}
    units = [block for block in description.blocks if id(block) in held] + modules.stages
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    # the stages are not in `modules.local`'s tree (they share its parts): set each unit
    for unit in units:
        assert isinstance(unit, FSDPModule)  # fully_shard made it one
        # A plain sum (gloo has no pre-multiplied sum): losses are weighted by share.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def keep_gathered(stages: list[StageModule]) -> None:
    """Keep every unit's gathered parameters after forward (accumulation at ``pp == 1``):
    a step's later micro-batches then issue no all-gather."""
    for stage in stages:
        _fsdp(stage).set_reshard_after_forward(False)  # recurses into the blocks


def reduce_on(stages: list[StageModule], *, is_last_backward: bool) -> None:
    """Reduce the gradients in the next backward only if it is the step's last; until then
    they accumulate unreduced and the parameters stay gathered."""
    for stage in stages:
        _fsdp(stage).set_requires_gradient_sync(is_last_backward)
        _fsdp(stage).set_reshard_after_backward(is_last_backward)


def _fsdp(stage: StageModule) -> FSDPModule:
    assert isinstance(stage, FSDPModule)  # shard_stages made it one
    return stage


def holder_of(*, step: int, is_clean: bool, layout: Layout | None, rank: int | None) -> Holder:
    """This rank's :class:`Holder`, with a sharded part's pieces counted as parts.

    Piece ``i`` of ``shard`` of part ``(pp, tp)`` is part ``(pp, i * tp + tp_i)`` of a cut
    ``(pp, tp * shard)``: a cut is whole when each of its ``pp * tp * shard`` pieces has a
    holder, which ``copy_sources.pick_sources`` already checks.

    Note:
        ``fsdp2`` and ``tp2`` share the cut ``(1, 2)``; only holders clean at the same step
        under both could mix, and then ``by_name`` finds their pieces' boxes do not cover
        the tensors and raises, rather than load a wrong state.
    """
    holder = Holder.of(step=step, is_clean=is_clean, layout=layout, rank=rank)
    if layout is None or rank is None or layout.shard == 1 or holder.part is None:
        return holder
    cut, part = piece_of(layout, rank)
    return Holder(holder.step, holder.last_step, part, cut)


def piece_of(layout: Layout, rank: int) -> tuple[Part, Part]:
    """``(cut, part)`` of what ``rank`` holds: its ``(pp, tp)`` part of the cut
    ``(pp, tp)``, or, sharded, piece ``i`` of it as part ``(pp, i * tp + tp_i)`` of the cut
    ``(pp, tp * shard)`` (:func:`holder_of`, the peer copies)."""
    coords = layout.coords(rank)
    return ((layout.pp, layout.tp * layout.shard),
            (coords.pp, layout.shard_index(rank) * layout.tp + coords.tp))
