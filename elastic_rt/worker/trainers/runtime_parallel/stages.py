"""One rank's modules for a layout: its stages, under the full model's names, tensor-split.

Rule: a stage is a :class:`StageModule` holding its parts of the described model under the
names they have in the whole model (``layers.2.attn.wq.weight``, not ``0.attn...``), and the
rank's stages together are one :class:`StageModule` too (``local``): its ``state_dict`` keys
are the unsplit model's FQNs, which is what checkpoints and restores move. Blocks are split
by the description's ``block_tp_plan``, and the modules before and after them this rank holds
by its ``outer_tp_plan``, on the round's tensor-parallel mesh, in place, before the optimizer
is made over the result: DTensor parameters, sharded (or replicated) within the tp group.

The modules are taken from the model ``build`` made for this round; nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from elastic_rt.errors import ConfigError
from elastic_rt.layout import Layout
from elastic_rt.worker.trainers.runtime_parallel.cut import cut_stages, stages_of_rank
from elastic_rt.worker.trainers.runtime_parallel.description import ModelDescription


class StageModule(nn.Module):
    """Modules applied one after the other, registered under their names in the whole model."""

    def __init__(self, parts: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.order = [name for name, _ in parts]
        for name, module in parts:
            _graft(self, name, module)

    def forward(self, x: Any) -> Any:
        for name in self.order:
            x = self.get_submodule(name)(x)
        return x


def _graft(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``name`` under ``root``, making plain containers on the way."""
    *path, leaf = name.split(".")
    here = root
    for part in path:
        child = getattr(here, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            here.add_module(part, child)
        here = child
    here.add_module(leaf, module)


@dataclass(frozen=True, slots=True)
class RankModules:
    """What one rank runs: its stages (in schedule order) and all of them as one module."""

    stage_ids: list[int]
    """The global index of each of this rank's stages."""
    stages: list[StageModule]
    local: StageModule
    """Every part this rank holds, under full names: its state and its optimizer's."""
    num_stages: int


def rank_modules(description: ModelDescription, layout: Layout, rank: int, *,
                 stages_per_rank: int) -> RankModules:
    """Cut ``description`` for ``layout`` and keep the stages of ``rank``.

    Raises:
        ConfigError: more stages than blocks.
    """
    num_stages = layout.pp * stages_per_rank
    first, last = description.outer_sizes()
    cuts = cut_stages(description.block_sizes(), num_stages, first=first, last=last)
    ids = stages_of_rank(layout.coords(rank).pp, layout.pp, stages_per_rank)
    stages = [StageModule(_stage_parts(description, cuts, s)) for s in ids]
    local = StageModule([part for s in ids for part in _stage_parts(description, cuts, s)])
    return RankModules(ids, stages, local, num_stages)


def _stage_parts(description: ModelDescription, cuts: list[range],
                 stage: int) -> list[tuple[str, nn.Module]]:
    names = description.names
    parts = [(names[f"before[{i}]"], m) for i, m in enumerate(description.before)] \
        if stage == 0 else []
    parts += [(description.block_name(b), description.blocks[b]) for b in cuts[stage]]
    if stage == len(cuts) - 1:
        parts += [(names[f"after[{i}]"], m) for i, m in enumerate(description.after)]
    return parts


def split_tensors(description: ModelDescription, modules: RankModules,
                  tp_mesh: DeviceMesh | None) -> None:
    """Apply the block plan to this rank's blocks, and the outer plan to its modules before
    and after them, on ``tp_mesh`` (None or size 1: nothing).

    Collective over the tp group (``parallelize_module`` takes rank 0's values of the mesh).

    Raises:
        ConfigError: ``tp > 1`` and the description has no ``block_tp_plan``.
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    if not description.block_tp_plan:
        raise ConfigError(f"the layout splits tensors {tp_mesh.size()} ways but the "
                          "ModelDescription has no block_tp_plan",
                          "Pass block_tp_plan=, or ModelLimits(tp_options=(1,)).")
    held = {id(m) for m in modules.local.modules()}
    for block in description.blocks:
        if id(block) in held:
            parallelize_module(block, tp_mesh, dict(description.block_tp_plan))
    for name, style in (description.outer_tp_plan or {}).items():
        module = description.model.get_submodule(name)
        if id(module) in held:
            parallelize_module(module, tp_mesh, style)


def local_params(modules: RankModules) -> list[nn.Parameter]:
    """This rank's parameters (what its optimizer steps)."""
    return list(modules.local.parameters())


def device_of(modules: RankModules) -> torch.device:
    param = next(iter(modules.local.parameters()), None)
    return torch.device("cpu") if param is None else param.device
