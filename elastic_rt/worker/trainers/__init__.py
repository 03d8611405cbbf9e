"""What the loop trains (moved here; split in the next commit)."""

from elastic_rt.worker.trainers.replicated import (
    BuildFn,
    OwnedStepTrainer,
    Progress,
    ReplicatedTrainer,
    Restoring,
    Trainer,
)

__all__ = ["BuildFn", "OwnedStepTrainer", "Progress", "ReplicatedTrainer", "Restoring", "Trainer"]
