"""elastic-rt: elastic, fault-tolerant training for PyTorch on an etcd rendezvous.

A script writes ``build(layout) -> TrainState`` and ``step(state, batch) -> loss``
and hands both to :func:`run`; recovery from node loss and growth is the runtime's.

Names are imported on first use: the agent and the CLI import submodules of this
package (config, rendezvous, events) and must not pay for, or depend on, torch.
"""

from __future__ import annotations

from typing import Any

from elastic_rt.lazy_names import resolve

_EXPORTS = {
    "Checkpointer": "elastic_rt.checkpoint",
    "Context": "elastic_rt.worker.context",
    "ElasticSampler": "elastic_rt.sampler",
    "GradSync": "elastic_rt.worker.grad_sync",
    "Layout": "elastic_rt.layout",
    "LoaderOptions": "elastic_rt.worker.batches",
    "ModelDescription": "elastic_rt.worker.trainers.runtime_parallel.description",
    "ModelLimits": "elastic_rt.layout",
    "ModelParallel": "elastic_rt.worker.trainers.runtime_parallel.schedule",
    "StepReport": "elastic_rt.worker.progress",
    "Stragglers": "elastic_rt.worker.stragglers",
    "TrainState": "elastic_rt.worker.train_state",
    "bf16_compress": "elastic_rt.worker.grad_sync",
    "context": "elastic_rt.worker.context",
    "plan_layout": "elastic_rt.layout",
    "run": "elastic_rt.worker.loop",
    "worker_device": "elastic_rt.accelerator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return resolve(__name__, _EXPORTS, name)
