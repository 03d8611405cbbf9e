"""The pipeline schedule of a round: :class:`ModelParallel` (the user's choice) and
:class:`Pipeline` (torch's ``PipelineStage``s and schedule over the round's pp group).

Rule: a stage keeps a reference to the group it was built on, so stages and schedules are
built anew every round (torch 2.13: rebuilt after a re-form they keep working, in 0.02 s).
Micro-batches: ``ModelParallel.n_microbatches``, else the loop's micro-batches
(``micro_batch_size``), else one per stage; lowered to a count that cuts the share into
equal micro-batches (a stage sizes its receive buffers by the first micro-batch it sees,
so one of another size fails) and that the schedule accepts. Every rank of one pipeline
has the same share, so they agree; a stage and schedule are kept per micro-batch shape.
The loss of each micro-batch is weighted by its share of the global batch
(``scale_grads=False``), so the gradients summed over micro-batches and data-parallel ranks
are those of the global batch's mean loss, as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from elastic_rt.errors import ConfigError
from elastic_rt.worker.trainers.runtime_parallel.stages import RankModules

_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelParallel:
    """How the runtime runs the pipeline it builds from a ``ModelDescription``.

    Passing it to ``run`` (with ``step=None``) picks the runtime-parallel family.

    Raises:
        ConfigError: an unknown schedule, a single-stage schedule with several stages per
            rank, or a count below 1.
    """

    schedule: str = "1F1B"
    """torch's name: ``GPipe``, ``1F1B``, ``Interleaved1F1B`` or ``LoopedBFS``."""
    stages_per_rank: int = 1
    """Stages per pipeline rank (> 1 for the interleaved and looped schedules)."""
    n_microbatches: int | None = None
    """Micro-batches per step; None: from ``micro_batch_size``, else one per stage."""

    def __post_init__(self) -> None:
        if self.schedule not in _SCHEDULES:
            raise ConfigError(f"ModelParallel(schedule={self.schedule!r}) is not supported",
                              f"Pass one of {', '.join(_SCHEDULES)}.")
        if self.stages_per_rank < 1 or (self.n_microbatches is not None
                                        and self.n_microbatches < 1):
            raise ConfigError(f"ModelParallel(stages_per_rank={self.stages_per_rank}, "
                              f"n_microbatches={self.n_microbatches}) has a count below 1",
                              "Pass counts >= 1 (n_microbatches may be None).")
        if self.is_multi != (self.stages_per_rank > 1):
            raise ConfigError(f"schedule {self.schedule!r} with stages_per_rank="
                              f"{self.stages_per_rank}",
                              "Use GPipe or 1F1B with one stage per rank, Interleaved1F1B "
                              "or LoopedBFS with several.")

    @property
    def is_multi(self) -> bool:
        """Whether the schedule runs several stages per rank."""
        return issubclass(get_schedule_class(self.schedule), PipelineScheduleMulti)

    def microbatches(self, *, loop_count: int, samples: int, stages: int, pp: int) -> int:
        """Micro-batches for a share of ``samples`` (> 0) the loop gave in ``loop_count``
        pieces: the most, up to the wanted count, that cut it evenly and that the schedule
        accepts; else the fewest above it.

        Raises:
            ConfigError: no count fits (a share smaller than ``pp`` under 1F1B).
        """
        wanted = self.n_microbatches or (loop_count if loop_count > 1 else stages)
        fits = [n for n in range(1, samples + 1) if samples % n == 0 and self._accepts(n, pp)]
        if not fits:
            raise ConfigError(f"a share of {samples} samples cannot be cut into equal "
                              f"micro-batches that schedule {self.schedule!r} accepts on {pp} "
                              "pipeline ranks", "Use a global batch of a multiple of dp x pp.")
        below = [n for n in fits if n <= wanted]
        return max(below) if below else min(fits)

    def _accepts(self, n: int, pp: int) -> bool:
        # torch 2.13: 1F1B wants n >= its stages; interleaved ones run n // pp rounds of
        # micro-batches, which must divide n
        if self.schedule not in ("GPipe", "LoopedBFS") and n < pp:
            return False
        return not self.is_multi or n % max(1, n // pp) == 0


class Pipeline:
    """This rank's stages of one round, as a schedule per micro-batch shape.

    Args:
        loss: the weighted loss of one micro-batch (called on the last stage only).
    """

    def __init__(self, options: ModelParallel, modules: RankModules, group: dist.ProcessGroup,
                 device: torch.device, loss: Callable[[Any, Any], torch.Tensor]) -> None:
        self.options, self.modules, self.group, self.device = options, modules, group, device
        self.loss = loss
        self.schedules: dict[tuple[int, int], PipelineScheduleSingle | PipelineScheduleMulti] = {}
        self.has_first = modules.stage_ids[0] == 0
        self.has_last = modules.stage_ids[-1] == modules.num_stages - 1

    def step(self, inputs: torch.Tensor, target: torch.Tensor, n_microbatches: int) -> None:
        """Forward and backward of the whole share through the pipeline. Collective (pp)."""
        key = (n_microbatches, len(inputs))
        schedule = self.schedules.get(key)
        if schedule is None:
            modules = self.modules
            stages = [PipelineStage(module, index, modules.num_stages, self.device,
                                    group=self.group)
                      for index, module in zip(modules.stage_ids, modules.stages)]
            kind = get_schedule_class(self.options.schedule)
            arg = stages if self.options.is_multi else stages[0]
            schedule = kind(arg, n_microbatches, loss_fn=self.loss, scale_grads=False)
            self.schedules[key] = schedule
        args = (inputs,) if self.has_first else ()
        schedule.step(*args, target=target if self.has_last else None, return_outputs=False)
