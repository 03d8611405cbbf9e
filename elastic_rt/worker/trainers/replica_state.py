"""A replicated ``TrainState`` as a restore moves it: its tensors in one order, and the rest.

Rule: the tensors are the model's state_dict in its own order, then the optimizer's state by
``param_groups`` order and sorted keys; everything else is one small :class:`Outline` (a few
KB: hyperparameters, non-tensor optimizer state, the ``TrainMeta``), the only part pickled::

    holder:   named_tensors(state) -> Outline.of(state, meta)     (broadcast by holder 0)
    receiver: initialize optimizer state -> tensors_for(state, outline) -> [transfer in place]
              -> load_rest(state, outline)

Every rank built the same model and optimizer, so the order is the same everywhere; a
receiver's optimizer state is created (``initialize_optimizer_state``, no user hooks) before
its tensors are matched against the holders', so each one is received into a tensor the
optimizer then keeps. A tensor a receiver lacks or holds in another shape or dtype is a
:class:`ReplicaMismatchError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elastic_rt.errors import ReplicaMismatchError
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.runtime_step import initialize_optimizer_state

Signature = tuple[tuple[str, tuple[int, ...], str], ...]
"""(name, shape, dtype) of every tensor, in transfer order."""


@dataclass(frozen=True, slots=True)
class Outline:
    """What a receiver needs besides the tensors' bytes, from holder 0."""

    meta: dict[str, Any]
    """``TrainMeta.encode()`` of the holders' step."""
    param_groups: list[dict[str, Any]]
    """The optimizer's ``param_groups`` as its ``state_dict`` gives them."""
    plain: dict[int, dict[str, Any]]
    """The optimizer's non-tensor state values, by parameter index."""
    model_extra: dict[str, Any]
    """Non-tensor entries of the model's state_dict (``get_extra_state``)."""
    signature: Signature
    has_optimizer_state: bool

    @classmethod
    def of(cls, state: TrainState, meta: TrainMeta) -> Outline:
        named = named_tensors(state)
        plain = {i: {k: v for k, v in state.optimizer.state[p].items()
                     if not isinstance(v, torch.Tensor)}
                 for i, p in enumerate(_params(state.optimizer)) if p in state.optimizer.state}
        extra = {k: v for k, v in state.model.state_dict().items()
                 if not isinstance(v, torch.Tensor)}
        return cls(meta=meta.encode(),
                   param_groups=state.optimizer.state_dict()["param_groups"],
                   plain={i: values for i, values in plain.items() if values},
                   model_extra=extra,
                   signature=tuple((n, tuple(t.shape), str(t.dtype)) for n, t in named),
                   has_optimizer_state=bool(state.optimizer.state))


def named_tensors(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the state, in the order every rank computes alike; each shares its
    memory with the model or optimizer (writing into it writes the state)."""
    named = [(f"model.{k}", v) for k, v in state.model.state_dict().items()
             if isinstance(v, torch.Tensor)]
    for index, param in enumerate(_params(state.optimizer)):
        values = state.optimizer.state.get(param, {})
        named.extend((f"optimizer.{index}.{key}", values[key]) for key in sorted(values)
                     if isinstance(values[key], torch.Tensor))
    return named


def tensors_for(state: TrainState, outline: Outline) -> list[torch.Tensor]:
    """This rank's tensors in the holders' order, their optimizer state created first.

    Raises:
        ReplicaMismatchError: a tensor the holders have is missing here or differs in
            shape or dtype.
    """
    if outline.has_optimizer_state:
        initialize_optimizer_state(state.optimizer)
    own = dict(named_tensors(state))
    tensors = []
    for name, shape, dtype in outline.signature:
        tensor = own.get(name)
        if tensor is None or (tuple(tensor.shape), str(tensor.dtype)) != (shape, dtype):
            here = "none" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
            raise ReplicaMismatchError(
                f"the replica's {name} is {shape} {dtype} on the ranks holding the state "
                f"but {here} on this rank",
                "Make build(layout) return the same model and optimizer on every rank.")
        tensors.append(tensor)
    return tensors


def load_rest(state: TrainState, outline: Outline, tensors: list[torch.Tensor]) -> None:
    """Give a receiver's optimizer (and model) the holders' non-tensor part, keeping the
    ``tensors`` (from :func:`tensors_for`) as its state tensors."""
    by_param: dict[int, dict[str, Any]] = {i: dict(v) for i, v in outline.plain.items()}
    for (name, _, _), tensor in zip(outline.signature, tensors):
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            by_param.setdefault(int(index), {})[key] = tensor
    # loading keeps tensors of the parameter's dtype and device as they are: no copy
    state.optimizer.load_state_dict({"state": by_param, "param_groups": outline.param_groups})
    if outline.model_extra:
        state.model.load_state_dict({**state.model.state_dict(), **outline.model_extra})


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the numbering of ``optimizer.state_dict()`` (group by group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]
