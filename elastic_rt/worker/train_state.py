"""What a user's ``build(layout)`` returns and ``step(state, batch)`` receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """The model, its optimizer, an optional LR scheduler and JSON-able extras of the user's.

    The runtime restores all of them after a re-form (from a surviving replica or a
    checkpoint); the step number and the sampler position are the runtime's own. The
    scheduler, when given, is stepped by the runtime once per optimizer step (after it),
    as a per-step schedule (e.g. warm-up then cosine) expects.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "extras": dict(self.extras),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.extras = dict(state.get("extras", {}))
