"""The last resort of every family's restore: the newest committed checkpoint, else the start.

Rule, for all three families alike (:func:`from_checkpoint_or_init`)::

    checkpoint committed?  -> its tensors, then its TrainMeta (position, then the rest)
    else nobody held state -> the initial state, step 0 (a fresh start only)
    else                   -> StateLostError: the job ends, it never starts over silently

"Nobody held state" counts the run's published progress too: workers the agents started
again (restart mode, the fallback) hold nothing, and would otherwise begin at step 0.

The tensors load by name (:func:`named_state`), so a checkpoint of any layout loads into
this one; the record beside them is decoded once, by :meth:`TrainMeta.decode`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from elastic_rt.errors import CheckpointNotFoundError, StateLostError
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.protocol import Restoring
from elastic_rt.worker.trainers.runtime_step import ReplicatedStep, initialize_optimizer_state

if TYPE_CHECKING:  # a job without checkpoints never loads torch.distributed.checkpoint
    from elastic_rt.checkpoint.checkpointer import CheckpointInfo

    Loaded = tuple[CheckpointInfo, TrainMeta]
    """A checkpoint that was loaded, and the record saved beside its tensors."""

logger = logging.getLogger(__name__)


def named_state(state: TrainState) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (FSDP's DTensors stay DTensors).

    An optimizer's own state_dict keys its state by parameter index, which collides between
    pipeline stages; the flattened form names each entry, so it loads into any layout.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        state.model, state.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": model_state, "optimizer": optim_state}


def load_checkpoint(target: dict[str, Any], at: Restoring) -> Loaded | None:
    """The newest committed checkpoint into ``target``, and its record.

    None when there is no checkpointer or nothing is committed yet.
    """
    if at.checkpoint is None:
        return None
    try:
        info = at.checkpoint.load(target, process_group=at.ctx.groups.world)
    except CheckpointNotFoundError:
        return None
    return None if info is None else (info, TrainMeta.decode(info.extra))


def load_checkpoint_into(state: TrainState, at: Restoring) -> Loaded | None:
    """The newest committed checkpoint into ``state``'s model and optimizer, as
    :func:`load_checkpoint`.

    A checkpoint loads into existing tensors, so an empty optimizer gets its state first,
    without a user-visible ``optimizer.step()``. When nothing is loaded that zero-step state
    is dropped again: Adam's step count 1 would make its bias correction lag one step
    behind a run without checkpoints.
    """
    if at.checkpoint is None:
        return None
    fresh_optimizer = initialize_optimizer_state(state.optimizer)
    target = named_state(state)
    loaded = load_checkpoint(target, at)
    if loaded is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(state.model, state.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))
    elif fresh_optimizer:
        state.optimizer.state.clear()
    return loaded


def from_checkpoint_or_init(at: Restoring, load: Callable[[], Loaded | None], *,
                            state: object, stepper: ReplicatedStep | None = None,
                            last: int = -1, init: Callable[[], None] = lambda: None) -> str:
    """Restore from the newest committed checkpoint, else start; where the state came from.

    Args:
        load: loads the checkpoint's tensors into this rank's state
            (:func:`load_checkpoint_into` or :func:`load_checkpoint`).
        state: what the record's non-position fields load into (:meth:`TrainMeta.apply`).
        last: the last step any rank committed, -1 on a fresh start.
        init: makes the initial state the same on every rank (collective), when nothing is
            committed on a fresh start.

    Raises:
        StateLostError: a rank held state (``last >= 0``), or the run had published
            progress, and nothing is committed.
    """
    loaded = load()
    at.progress.is_dirty = False
    if loaded is not None:
        info, meta = loaded
        at.take(meta, state, stepper)
        if last > at.progress.step:
            logger.warning("no surviving copy of every piece at one step; rolled back from "
                           "step %d to %d", last, at.progress.step)
        return f"checkpoint {info.name}"
    reached = at.run_reached()
    if last >= 0 or reached > 0:
        raise StateLostError(
            f"the job's state at step {max(last, reached)} was lost with no surviving copy and no "
            "committed checkpoint, so it cannot go on without starting over; pass "
            "checkpoint=Checkpointer(url, every_steps=N) to ert.run")
    init()
    at.progress.step = 0
    return "init"
