"""What ``elastic_rt.run`` was asked for, checked once, before anything starts.

The rule: every combination the runtime cannot train is refused here with one
:class:`~elastic_rt.errors.ConfigError` line (the field, its value, the fix), so that
no rank starts a round it would fail in. Frozen: the loop reads these for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from elastic_rt.config import DEFAULT_REFORM_TIMEOUT
from elastic_rt.errors import ConfigError
from elastic_rt.layout import ModelLimits


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """The knobs of one elastic run (see :func:`elastic_rt.run` for each one's meaning).

    Raises:
        ConfigError: from ``__post_init__``, for a combination that cannot train.
    """

    global_batch_size: int
    """Samples per optimizer step over all ranks; fixed whatever the world size."""
    max_steps: int
    is_step_owned: bool = False
    """``step=None``: the object ``build`` returns owns its step (model parallelism)."""
    is_runtime_parallel: bool = False
    """``model_parallel`` is given: the runtime builds pp and tp from a ModelDescription."""
    seed: int = 0
    micro_batch_size: int | None = None
    limits: ModelLimits = field(default_factory=ModelLimits)
    max_failed_steps: int = 3
    """The same step failing this often is raised, not retried; a try that failed because
    a rank was lost (the next round lacks it) does not count."""
    reform_timeout: timedelta = DEFAULT_REFORM_TIMEOUT
    """The most to wait for a round that includes this node."""
    autocast_dtype: torch.dtype | None = None
    clip_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.max_steps < 0 or self.global_batch_size < 1:
            raise ConfigError(
                f"max_steps={self.max_steps}, global_batch_size={self.global_batch_size}",
                "Pass max_steps >= 0 and global_batch_size >= 1.",
            )
        if self.is_runtime_parallel:
            self._check_runtime_parallel()
            return
        if self.is_step_owned and self.micro_batch_size is not None:
            raise ConfigError(
                "micro_batch_size is set but build() owns its step (step=None)",
                "Split micro-batches inside the object's step(), or pass a step function.",
            )
        if self.is_step_owned and (self.autocast_dtype is not None
                                   or self.clip_grad_norm is not None):
            raise ConfigError(
                "autocast_dtype or clip_grad_norm is set but build() owns its step (step=None)",
                "Apply autocast and clipping inside the object's step(), or pass a step function.",
            )
        if self.is_sharded and self.autocast_dtype == torch.float16:
            # float16 needs a loss scaler whose overflow check agrees across the shards
            raise ConfigError(
                "autocast_dtype=torch.float16 with a sharded layout (max_shard > 1)",
                "Pass autocast_dtype=torch.bfloat16 (FSDP's mixed precision, no scaler), "
                "or train replicated (max_shard=1).",
            )

    def _check_runtime_parallel(self) -> None:
        if not self.is_step_owned:
            raise ConfigError("step is set with model_parallel",
                              "Pass step=None: the loss is ModelDescription.loss.")
        # max_shard is the family's own (FSDP over dp, composed with pp and tp), and so are
        # clip_grad_norm (over the whole model's norm) and bfloat16 (FSDP's mixed precision
        # when sharded, autocast when not). float16 needs a GradScaler whose overflow check
        # agrees across every stage, tp piece and shard: there is none.
        if self.autocast_dtype == torch.float16:
            raise ConfigError("autocast_dtype=torch.float16 with model_parallel",
                              "Pass autocast_dtype=torch.bfloat16 (it needs no loss scaler).")

    @property
    def is_sharded(self) -> bool:
        """The runtime trains a step function under FSDP (``limits.max_shard > 1``)."""
        return not self.is_step_owned and self.limits.max_shard > 1
