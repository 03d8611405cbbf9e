"""The runtime's step, shared by the replicated and the sharded families.

Rule: one optimizer step over this rank's micro-batches, weighted by their share of the
global batch, so the update is the one-rank update on the whole global batch for any split.

The user's ``step(state, batch)`` returns the mean loss of the batch it is given; this
module does the rest the way a careful torchrun + DDP script does: backward per
micro-batch with the gradients summed over the data-parallel group during the last
backward (see ``grad_sync``), optional autocast with a ``GradScaler`` for float16,
clipping by global norm after the average (and after unscaling), the optimizer step and
the scheduler step. Each micro-batch is moved to the model's device first (the device of
its first parameter), so a model built on ``cuda:LOCAL_RANK`` gets CUDA batches.
The sharded family hands :meth:`ReplicatedStep.bind` FSDP's own reducer instead.

The scaler's state belongs to the runtime, not to ``TrainState``: it is
:attr:`TrainMeta.runtime`, and travels with the rest of the state when a survivor restores
a newcomer, and into checkpoints.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from elastic_rt.errors import ConfigError
from elastic_rt.process_groups import abandoned_group_count, release_abandoned
from elastic_rt.worker.abort import stop_compute_on_notice
from elastic_rt.worker.batches import to_device
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.failures import user_code
from elastic_rt.worker.grad_sync import GradientBuckets, GradSync

StepFn = Callable[[TrainState, Any], torch.Tensor]

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
ABANDONED_SETTLE_S = 0.5
"""How long a re-bind waits for an abandoned round's collectives to fail before it gives up
the gradient buckets they may still write: a survivor's usually fail within milliseconds of
the new round (its peers let theirs go), and new buckets would cost the state's gradients in
memory again (402 MB beside a 1.2 GB state in 2 of 3 trials); one blocked on a hung peer
never finishes, and the wait is then half a second added to a hang's recovery."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOptions:
    """What the runtime does around the user's step."""

    grad_sync: GradSync = GradSync()
    autocast_dtype: torch.dtype | None = None
    """Run ``step`` under ``torch.autocast`` with this dtype; float16 adds a GradScaler."""
    clip_grad_norm: float | None = None
    """Clip the averaged gradients to this global L2 norm before the optimizer step."""
    accumulates: bool = False
    """A step may run several micro-batches (``micro_batch_size`` is set)."""

    def __post_init__(self) -> None:
        if self.autocast_dtype is not None and self.autocast_dtype not in _AUTOCAST_DTYPES:
            raise ConfigError(f"autocast_dtype={self.autocast_dtype} is not supported",
                              "Pass torch.bfloat16, torch.float16 or None.")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm} is not positive",
                              "Pass a norm > 0, or None to not clip.")


class GradientReducer(Protocol):
    """Sums gradients over the data-parallel ranks around a step's backward passes
    (``grad_sync.GradientBuckets``; ``fsdp.ShardedGradients`` for a sharded model)."""

    def zero_grad(self) -> None: ...

    def begin(self, *, is_last_backward: bool) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class StepLoss:
    local_mean: float
    """Mean loss over this rank's samples (nan for a rank without samples)."""
    contribution: float
    """This rank's part of the global-batch mean: the sum over ranks is that mean."""


class ReplicatedStep:
    """Trains one ``TrainState`` step by step; :meth:`bind` it to each round's group.

    Args:
        state: what ``build`` returned.
        step_fn: the user's step.
        options: precision, clipping and gradient averaging.
        stop_on_notice: a replicated model's step stops computing once a newer round
            drops a member (``abort.stop_compute_on_notice``).
    """

    def __init__(self, state: TrainState, step_fn: StepFn, options: StepOptions, *,
                 stop_on_notice: bool = False) -> None:
        self.state, self.step_fn, self.options = state, step_fn, options
        if stop_on_notice:
            stop_compute_on_notice(state.model)
        self.device = next(state.model.parameters()).device
        self.device_type = self.device.type
        is_fp16 = options.autocast_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device_type) if is_fp16 else None
        self.buckets: GradientReducer | None = None
        self.compute_seconds = 0.0
        """The last step's forward and backward, up to the wait for the last bucket
        (on CUDA, the host's side of it: kernels are timed only where they block)."""

    def bind(self, dp_group: dist.ProcessGroup | None,
             reducer: GradientReducer | None = None) -> None:
        """Average over this round's data-parallel group from now on (through ``reducer``
        when given, e.g. a sharded model's own); None: no round yet (a newcomer's buckets
        made before it is admitted)."""
        # The same buffers serve the new round only when no collective of an abandoned
        # round can still complete into them (none of the buckets' own is running, or its
        # groups are all released): a hung peer that wakes could otherwise finish an old
        # all-reduce in the middle of a new step. A step stopped on the notice before its
        # first bucket launched leaves none (0.5 s of settling and 400 MB of new buckets,
        # 0.8 s of a 1.2 GB restore that moved no byte, before).
        # (asked again here: after the restore's agreement a dead peer's round has
        # usually finished failing, which it had not yet when the groups were made)
        if reducer is None and isinstance(self.buckets, GradientBuckets):
            if not self.buckets.may_still_write():
                release_abandoned()  # what is idle goes; nothing else writes into the buckets
                self.buckets.rebind(dp_group)
                return
            release_abandoned(settle_s=ABANDONED_SETTLE_S)
            if abandoned_group_count() == 0:
                self.buckets.rebind(dp_group)
                return
        was_bound = self.buckets is not None
        self.unbind()
        if was_bound and reducer is None:
            # The last buckets' gradients are views into them: dropped first, the new
            # buckets take their place instead of doubling them (400 MB at 100M
            # parameters). Nothing reads them: every step starts from none.
            for param in self.state.model.parameters():
                param.grad = None
        self.buckets = reducer or GradientBuckets(self.state.model, dp_group,
                                                  self.options.grad_sync)

    def release_group(self) -> None:
        """Let go of the round's group, which is about to be destroyed, but keep the
        gradient buckets' buffers for the next round (:meth:`bind` decides whether they
        may serve it); a reducer of the round's own (a sharded model's) goes whole."""
        if isinstance(self.buckets, GradientBuckets):
            self.buckets.rebind(None)
        else:
            self.unbind()

    def unbind(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None

    def run(self, micro_batches: list[tuple[Any, int]], *, global_len: int,
            rank: int, step: int, before_update: Callable[[], None] = lambda: None) -> StepLoss:
        """One optimizer step over this rank's micro-batches; ``before_update`` runs after
        the last collective and before the parameters change (a stream finishing).

        Raises:
            UserCodeError: the user's step or its backward raised (not a peer's failure).
            RuntimeError: a collective failed.
        """
        assert self.buckets is not None, "bind() first"
        began = time.perf_counter()
        self.buckets.zero_grad()
        local_sum, contribution = 0.0, 0.0
        for i, (batch, size) in enumerate(micro_batches):
            self.buckets.begin(is_last_backward=i == len(micro_batches) - 1)
            with user_code(rank=rank, step=step):
                with self._autocast():
                    loss = self.step_fn(self.state, to_device(batch, self.device))
                weight = size / global_len  # the sum over ranks is the global mean
                scaled = loss * weight
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            value = float(loss.detach())
            local_sum += value * size
            contribution += value * weight
        self.compute_seconds = time.perf_counter() - began
        self.buckets.finish()
        before_update()
        self._apply_update()
        samples = sum(size for _, size in micro_batches)
        return StepLoss(local_mean=local_sum / samples if samples else float("nan"),
                        contribution=contribution)

    def _apply_update(self) -> None:
        optimizer, scaler = self.state.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        if self.options.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.state.model.parameters(),
                                           self.options.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if self.state.scheduler is not None:
            self.state.scheduler.step()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.options.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    # state that is the runtime's, not the user's ---------------------------------------
    def runtime_state(self) -> dict[str, Any]:
        """JSON-able: the scaler's state (empty without one)."""
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_runtime_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create an empty optimizer's state tensors without running anyone's hooks.

    A checkpoint is loaded into existing tensors, so Adam's moments must exist first.
    torch's helper does that with a real ``optimizer.step()`` at lr 0, which runs the
    user's step hooks (and the global ones) an extra time; here the class's own step
    runs with every hook set aside and the gradients put back afterwards.

    Returns:
        Whether state was created (the caller clears it again if nothing is loaded).
    """
    if optimizer.state:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_lrs = [group.get("lr") for group in optimizer.param_groups]
    raw_step = getattr(type(optimizer).step, "__wrapped__", None)
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        with _hooks_set_aside(optimizer):
            if raw_step is not None:
                raw_step(optimizer)
            else:
                optimizer.step()
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr
    return True


@contextlib.contextmanager
def _hooks_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    from torch.optim import optimizer as optim_module

    saved = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             dict(optim_module._global_optimizer_pre_hooks),
             dict(optim_module._global_optimizer_post_hooks))
    optimizer._optimizer_step_pre_hooks = type(saved[0])()
    optimizer._optimizer_step_post_hooks = type(saved[1])()
    optim_module._global_optimizer_pre_hooks.clear()
    optim_module._global_optimizer_post_hooks.clear()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = saved[:2]
        optim_module._global_optimizer_pre_hooks.update(saved[2])
        optim_module._global_optimizer_post_hooks.update(saved[3])
