"""What a user's ``build(layout)`` returns and ``step(state, batch)`` receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """The model, its optimizer and any JSON-able extras of the user's.

    The runtime restores all three after a re-form (from a surviving replica or a
    checkpoint); the step number and the sampler position are the runtime's own.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    extras: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "extras": dict(self.extras),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.extras = dict(state.get("extras", {}))
