"""What ``build(layout)`` returns for the runtime to cut: :class:`ModelDescription`.

Rule: the model is a sequence ``after(blocks(before(x)))``: the modules in ``before`` applied
in order, then every block of ``blocks`` in order, then the modules in ``after``; each takes
one tensor and returns one. Every parameter of ``model`` lives in exactly one of them, so
any cut of the blocks into pipeline stages holds every parameter once, under its name in
``model`` (its FQN): the state is keyed by those names in every layout, which is what lets a
``pp2 x tp2`` cut load from a ``pp3`` one.

The description is plain torch: ``model`` is an ordinary ``nn.Module`` that trains without
the runtime, ``block_tp_plan`` is what ``parallelize_module`` takes for one block and
``outer_tp_plan`` what it takes for the modules before and after the blocks, ``loss`` is a
function of (output, target), ``optimizer`` makes the optimizer over the parameters a rank
holds (the runtime builds it, after cutting and tensor-splitting).

Sequence parallelism is a matter of the two plans, in torch's vocabulary: an embedding whose
output is ``Shard(1)``, ``SequenceParallel()`` norms, block inputs gathered by
``PrepareModuleInput`` or ``ColwiseParallel(input_layouts=Shard(1))``, block outputs
reduce-scattered by ``RowwiseParallel(output_layouts=Shard(1))``, a head that gathers its
input. Activations then pass between blocks, and between pipeline stages, as this rank's
slice of the sequence (plain tensors); the sequence length must be a multiple of the ``tp``
degrees the limits allow. Without an ``outer_tp_plan`` the modules before and after the
blocks are replicated on the tensor-parallel ranks and so are the activations.

Does not cover: meta-device init (every rank builds the whole model, then keeps its cut).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from elastic_rt.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(output, target)``: the mean loss over the samples of ``output``."""
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Makes the optimizer over the parameters one rank holds."""


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """One model, described once, for the runtime to cut into pipeline stages and split by
    a tensor-parallel plan in every round's layout.

    Invariant: ``blocks`` is a non-empty ``ModuleList`` of ``model``; ``before``, ``blocks``
    and ``after`` are submodules of ``model`` that together hold each of its parameters
    once; every key of ``block_tp_plan`` names a submodule of every block, and every key of
    ``outer_tp_plan`` a module of ``model`` in (or at) one of ``before`` and ``after``.

    Raises:
        ConfigError: from ``__post_init__``, when the invariant does not hold.
    """

    model: nn.Module
    """The whole model, as trained in one process: ``model(x) == after(blocks(before(x)))``."""
    blocks: nn.ModuleList
    """The repeated blocks; pipeline stages are contiguous runs of them."""
    loss: LossFn
    """Mean loss of a (micro-)batch: ``loss(output, target)``."""
    optimizer: OptimizerFactory
    """``optimizer(params)`` -> the optimizer over this rank's parameters."""
    before: tuple[nn.Module, ...] = ()
    """Modules applied before the blocks, in order (an embedding): on the first stage."""
    after: tuple[nn.Module, ...] = ()
    """Modules applied after the blocks, in order (a norm, a head): on the last stage."""
    block_tp_plan: Mapping[str, ParallelStyle] | None = None
    """Per block, ``{submodule name: ColwiseParallel() | RowwiseParallel() | ...}``, as
    ``parallelize_module`` takes it; needed for ``tp > 1``."""
    outer_tp_plan: Mapping[str, ParallelStyle] | None = None
    """``{name in model: style}`` for modules in ``before`` and ``after`` (or inside them),
    e.g. ``{"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1),
    output_layouts=Replicate())}``; applied with the block plan when ``tp > 1``."""
    names: dict[str, str] = field(init=False, repr=False, compare=False)
    """Each part's name in ``model``: ``before``/``after`` modules and the blocks' list."""

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, nn.ModuleList) or len(self.blocks) == 0:
            raise ConfigError("ModelDescription.blocks is not a non-empty nn.ModuleList",
                              "Pass the model's repeated blocks as one nn.ModuleList.")
        found = {id(module): name for name, module in self.model.named_modules()}
        names: dict[str, str] = {}
        for role, module in self._parts():
            if id(module) not in found or found[id(module)] == "":
                raise ConfigError(f"ModelDescription.{role} holds a {type(module).__name__} "
                                  "that is not a submodule of model",
                                  f"Pass modules of model itself (e.g. model.{role}).")
            names[role] = found[id(module)]
        object.__setattr__(self, "names", names)
        self._check_coverage()
        self._check_plan()

    def _parts(self) -> list[tuple[str, nn.Module]]:
        return ([(f"before[{i}]", m) for i, m in enumerate(self.before)]
                + [("blocks", self.blocks)]
                + [(f"after[{i}]", m) for i, m in enumerate(self.after)])

    def _check_coverage(self) -> None:
        """Every parameter once: one left out would be lost by every pipeline cut."""
        covered: dict[int, str] = {}
        for role, module in self._parts():
            for param in module.parameters():
                if id(param) in covered:
                    raise ConfigError(f"a parameter is in both ModelDescription."
                                      f"{covered[id(param)]} and .{role}",
                                      "List each module in one part only.")
                covered[id(param)] = role
        for name, param in self.model.named_parameters():
            if id(param) not in covered:
                raise ConfigError(f"model parameter {name!r} is in none of before, blocks, after",
                                  "List the module that holds it in before= or after=.")

    def _check_plan(self) -> None:
        for index, block in enumerate(self.blocks):
            modules = dict(block.named_modules())
            for key in self.block_tp_plan or {}:
                if key not in modules:
                    raise ConfigError(f"block_tp_plan names {key!r}, which block {index} lacks",
                                      "Key the plan by submodule names inside one block.")
        outer = {self.names[role] for role, _ in self._parts() if role != "blocks"}
        for key in self.outer_tp_plan or {}:
            if not any(key == name or key.startswith(name + ".") for name in outer) \
                    or key not in dict(self.model.named_modules()):
                raise ConfigError(f"outer_tp_plan names {key!r}, which is no module of "
                                  "before= or after=",
                                  "Key it by names in model of those modules (e.g. 'embed').")

    def block_name(self, index: int) -> str:
        """The name of block ``index`` in ``model`` (e.g. ``layers.3``)."""
        return f"{self.names['blocks']}.{index}"

    def block_sizes(self) -> list[int]:
        """Parameters per block (what the stages are balanced by)."""
        return [_count(block.parameters()) for block in self.blocks]

    def outer_sizes(self) -> tuple[int, int]:
        """Parameters before and after the blocks (on the first and the last stage)."""
        return (sum(_count(m.parameters()) for m in self.before),
                sum(_count(m.parameters()) for m in self.after))


def _count(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)
