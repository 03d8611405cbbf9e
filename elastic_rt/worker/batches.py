"""Each step's micro-batches, through a torch ``DataLoader`` fed by the ``ElasticSampler``.

Loading is torch's own: worker processes, prefetching, pinned memory and persistent
workers are ``DataLoader`` options a torchrun user already knows. What the runtime adds
is the one rule that keeps elasticity exact: the loader's index stream is made from the
sampler's committed position and the current data-parallel split, and it is made anew
(:meth:`BatchSource.reset`) whenever either may have changed — after a re-form, and
before a retried step. Batches prefetched for the old split are dropped with the old
iterator, so no sample is lost or repeated. Persistent workers survive the reset: only
the index stream restarts, not the worker processes.

Batches are collated on the CPU; :func:`to_device` moves each one to the model's device
just before the user's step (the step runs where the model is: ``cuda:LOCAL_RANK`` when
the model was built there). With ``pin_memory`` the copy is asynchronous.

Not supported: iterable-style datasets. Their order is the dataset's own, so the runtime
cannot re-split what is left of it among a new set of ranks; :func:`check_dataset`
refuses them with the alternative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from elastic_rt.errors import ConfigError
from elastic_rt.sampler import ElasticSampler


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderOptions:
    """How batches are loaded: the ``DataLoader`` arguments of the same names."""

    num_workers: int = 0
    """Loader processes; 0 loads in the training process, between steps."""
    prefetch_factor: int | None = None
    """Micro-batches each loader process keeps ready (torch's default, 2, when None)."""
    pin_memory: bool = False
    """Page-locked host memory for faster copies to a GPU; ignored without one."""
    persistent_workers: bool = True
    """Keep loader processes across re-forms and epochs (only with ``num_workers > 0``)."""
    collate_fn: Callable[[list[Any]], Any] = default_collate
    """Turns a micro-batch's samples into what ``step`` receives."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"LoaderOptions.num_workers={self.num_workers} is negative",
                              "Pass num_workers=0 (load in the training process) or more.")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ConfigError("LoaderOptions.prefetch_factor is set but num_workers is 0",
                              "Set num_workers >= 1, or leave prefetch_factor unset.")


def check_dataset(dataset: Any) -> None:
    """Refuse datasets the sampler cannot index.

    Raises:
        ConfigError: an ``IterableDataset``, or an object without ``len`` and indexing.
    """
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise ConfigError(
            f"dataset {type(dataset).__name__} is not map-style (len and indexing); an "
            "iterable dataset's order cannot be re-split when the world changes",
            "Pass a map-style dataset, e.g. index your shards so dataset[i] returns sample i.",
        )


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (nested dicts, lists, tuples).

    Other values are kept as they are, and so is everything when ``device`` is the CPU
    (the tensors are already there). A CUDA copy is ``non_blocking``: ordered on the
    current stream before the step's kernels, and asynchronous from pinned memory.
    """
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:  # a mapping that cannot be built from a dict (defaultdict)
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class MapDataset(Protocol):
    """What the loop can train on: ``len`` and ``dataset[i]`` (a torch ``Dataset``, a list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class _IndexStream:
    """The loader's ``batch_sampler``: the sampler's micro-batches as of the last reset."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.iter_micro_batches()


class BatchSource:
    """Hands the loop one step's micro-batches at a time, each with its sample count.

    Args:
        dataset: map-style (see :func:`check_dataset`).
        sampler: whose position and split decide the samples.
        options: the loader's settings.
    """

    def __init__(self, dataset: MapDataset, sampler: ElasticSampler,
                 options: LoaderOptions) -> None:
        check_dataset(dataset)
        self.sampler = sampler
        self.collate = options.collate_fn
        workers = options.num_workers
        self.loader: DataLoader[Any] = DataLoader(
            dataset,  # type: ignore[arg-type]  # any map-style object, not only Dataset
            batch_sampler=_IndexStream(sampler),
            num_workers=workers,
            collate_fn=options.collate_fn,
            pin_memory=options.pin_memory and torch.cuda.is_available(),
            prefetch_factor=options.prefetch_factor if workers else None,
            persistent_workers=options.persistent_workers and workers > 0,
        )
        self._iterator: Iterator[Any] | None = None

    def reset(self) -> None:
        """Drop prefetched batches; the next step reads from the sampler's state now."""
        self._iterator = None

    def next_step(self) -> list[tuple[Any, int]]:
        """The current step's non-empty micro-batches (collated) with their sizes.

        Empty for a rank whose share of this global batch is empty.
        """
        sizes = [len(micro) for micro in self.sampler.micro_batches() if micro]
        if not sizes:
            return []
        if self._iterator is None:
            self._iterator = iter(self.loader)
        return [(next(self._iterator), size) for size in sizes]

    def close(self) -> None:
        """Stop loader processes now rather than at interpreter exit."""
        self._iterator = None
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
