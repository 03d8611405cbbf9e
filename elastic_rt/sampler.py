"""ElasticSampler: a data-parallel sampler that stays exact when the world changes.

Every epoch has one seeded permutation of the dataset, the same on every rank and platform.
The sampler's whole state is a *global* position: how many samples of this epoch's permutation
committed steps have consumed. The next global batch is the next ``global_batch_size`` indices
of the permutation, whoever is in the world; the current data-parallel ranks split that batch
into contiguous shares that differ by at most one sample. So when a round re-forms with a
different ``dp_size``, nothing has to be exchanged but the position: what is left is simply
split among the ranks there are now, and no sample is repeated or dropped.

Guarantees:
    * Over an epoch, the union of all ranks' local batches is every index exactly once
      (with ``drop_last``, every index of the full batches), whatever world changes happen
      between steps.
    * The sequence of global batches does not depend on the world: a run with failures sees
      the same batches in the same order as a run without (DESIGN section 4, "same training").
    * :meth:`loss_scale` makes a data-parallel mean of per-rank mean losses equal the mean over
      the global batch, also when shares are uneven.

Not guaranteed: a world change *inside* a step. A step whose global batch was not fully
consumed is retried from the same position; only :meth:`advance`, called after a committed
step, moves the position.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Iterator, Mapping

import torch

from elastic_rt.errors import ConfigError

logger = logging.getLogger(__name__)

_STATE_KEYS = ("seed", "epoch", "position", "step", "global_batch_size", "dataset_len")


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for ``(seed, epoch)``, the same in every process and platform.

    Python's ``hash()`` is salted per process, so it cannot be used; neighbouring epochs must
    not get correlated seeds either, hence a cryptographic hash.
    """
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def share_bounds(n: int, dp_rank: int, dp_size: int,
                 weights: tuple[int, ...] | None = None) -> tuple[int, int]:
    """The ``[start, end)`` of ``dp_rank``'s contiguous share of ``n`` items.

    Without ``weights`` the first ``n % dp_size`` ranks get one item more, so shares differ
    by at most one. With them (one per rank, e.g. a straggler's cut down), the shares are
    proportional: rank r ends at ``floor(n * sum(weights[:r+1]) / sum(weights))``.
    """
    if weights is None:
        base, extra = divmod(n, dp_size)
        start = dp_rank * base + min(dp_rank, extra)
        return start, start + base + (1 if dp_rank < extra else 0)
    total = sum(weights)
    before = sum(weights[:dp_rank])
    return n * before // total, n * (before + weights[dp_rank]) // total


class ElasticSampler:
    """Yields this data-parallel rank's share of a fixed-size global batch, step by step.

    Invariants: ``0 <= position < dataset_len`` between steps; the global batch size never
    changes; ``set_world`` changes only how a global batch is split, never which samples it
    holds. Implements ``state_dict``/``load_state_dict`` (torch's ``Stateful``), so it can be
    checkpointed or broadcast to a joining rank as a small JSON-able dict.

    Args:
        dataset_len: number of samples in the dataset.
        global_batch_size: samples per optimizer step over all ranks, fixed for the run.
        seed: seeds every epoch's permutation.
        shuffle: permute each epoch; if False, samples go in index order.
        drop_last: drop the last global batch of an epoch if it is smaller than the others.
        micro_batch_size: the most samples one forward/backward takes (gradient accumulation);
            None means the whole local batch at once.

    Raises:
        ConfigError: a size is not positive, or ``drop_last`` would leave no batch at all.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        micro_batch_size: int | None = None,
    ) -> None:
        _check_positive("dataset_len", dataset_len)
        _check_positive("global_batch_size", global_batch_size)
        if micro_batch_size is not None:
            _check_positive("micro_batch_size", micro_batch_size)
        if drop_last and global_batch_size > dataset_len:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is larger than the dataset "
                f"({dataset_len} samples), so drop_last leaves no batch",
                "Use a smaller global batch or drop_last=False.",
            )
        self._dataset_len = dataset_len
        self._global_batch_size = global_batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._drop_last = drop_last
        self._micro_batch_size = micro_batch_size
        self._epoch = 0
        self._position = 0
        self._step = 0
        self._dp_rank = 0
        self._dp_size = 1
        self._weights: tuple[int, ...] | None = None
        self._order: tuple[int, int, torch.Tensor] | None = None  # (seed, epoch, permutation)

    @property
    def epoch(self) -> int:
        """The current epoch (data pass), counted from 0."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global samples of this epoch that committed steps have consumed."""
        return self._position

    @property
    def step(self) -> int:
        """Global steps committed so far, across epochs."""
        return self._step

    @property
    def dp_rank(self) -> int:
        """This rank's index among the current data-parallel ranks."""
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks share each global batch now."""
        return self._dp_size

    @property
    def global_batch_size(self) -> int:
        """Samples per full global batch; fixed for the run."""
        return self._global_batch_size

    def set_world(self, dp_rank: int, dp_size: int) -> None:
        """Split the remaining batches among ``dp_size`` ranks; call after every re-form.

        ``dp_size`` need not divide the global batch. Iterators made before this call keep
        the old split: make a fresh one (e.g. a fresh ``iter(dataloader)``).

        Raises:
            ValueError: ``dp_rank`` is outside ``[0, dp_size)``.
        """
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if (dp_rank, dp_size) != (self._dp_rank, self._dp_size):
            logger.info(
                "Sampler re-split: dp_rank %s of %s at epoch %s position %s",
                dp_rank, dp_size, self._epoch, self._position,
            )
        self._dp_rank, self._dp_size, self._weights = dp_rank, dp_size, None

    @property
    def weights(self) -> tuple[int, ...] | None:
        """Each rank's relative share of a global batch; None: equal shares."""
        return self._weights

    def set_weights(self, weights: tuple[int, ...] | None) -> None:
        """Split the global batches in proportion to ``weights`` (one per rank, positive),
        e.g. less to a straggler; None: equal shares. Reset by :meth:`set_world`. Which
        samples a global batch holds never changes, so training stays exact.

        Raises:
            ValueError: not one positive weight per rank.
        """
        if weights is not None and (len(weights) != self._dp_size or min(weights) < 1):
            raise ValueError(f"{weights} is not one positive weight for each of "
                             f"{self._dp_size} ranks")
        self._weights = weights

    def global_batch(self) -> list[int]:
        """Dataset indices of the next global batch, the same on every rank."""
        return self._batch_at(self._epoch, self._position)

    def local_batch(self) -> list[int]:
        """This rank's contiguous share of :meth:`global_batch`; may be empty."""
        batch = self.global_batch()
        start, end = share_bounds(len(batch), self._dp_rank, self._dp_size, self._weights)
        return batch[start:end]

    def micro_batches(self) -> list[list[int]]:
        """:meth:`local_batch` cut into chunks of at most ``micro_batch_size``.

        Always at least one chunk (``[[]]`` for an empty share), so that every rank runs a
        backward pass and joins the gradient all-reduce even when it has no samples.
        """
        local = self.local_batch()
        size = self._micro_batch_size
        if size is None or not local:
            return [local]
        return [local[i : i + size] for i in range(0, len(local), size)]

    def loss_scale(self, batch: list[int] | None = None) -> float:
        """The factor that turns a per-rank mean loss into this rank's share of the global mean.

        DDP averages gradients over ``dp_size`` ranks. Multiplying a rank's mean loss over
        ``batch`` (default: its whole local batch; pass a micro batch for gradient
        accumulation and sum the scaled losses) by ``len(batch) / len(global) * dp_size``
        makes that average equal the mean over the global batch, for uneven shares too.
        A rank with an empty share gets 0.
        """
        size = len(self.local_batch()) if batch is None else len(batch)
        return size / self._global_len(self._position) * self._dp_size

    def advance(self) -> None:
        """Mark the current global batch consumed by a committed step; rolls the epoch."""
        self._position += self._global_len(self._position)
        self._step += 1
        if self._is_epoch_done(self._position):
            self._epoch += 1
            self._position = 0

    def advanced(self) -> ElasticSampler:
        """A copy with the current global batch consumed: the sampler as it will be once the
        step in progress commits (for a record of that step taken inside it)."""
        after = copy.copy(self)
        after.advance()
        return after

    def state_dict(self) -> dict[str, int]:
        """The sampler's state as a JSON-able dict (the world split is not part of it)."""
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "step": self._step,
            "global_batch_size": self._global_batch_size,
            "dataset_len": self._dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state``, seed included, so the permutation is the saved run's.

        Raises:
            ConfigError: keys are missing, a count is out of range, or the dataset length or
                global batch size differ from this sampler's (resuming would repeat or skip
                samples). The sampler is unchanged then.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ConfigError(
                f"sampler state lacks {', '.join(missing)}",
                "Load a state written by ElasticSampler.state_dict().",
            )
        values = {key: int(state[key]) for key in _STATE_KEYS}
        ours = {"dataset_len": self._dataset_len, "global_batch_size": self._global_batch_size}
        for key in ours:
            if values[key] != ours[key]:
                raise ConfigError(
                    f"sampler state has {key} {values[key]} but this sampler has {ours[key]}",
                    f"Build the sampler with {key}={values[key]} (the saved run's), "
                    "or start the run afresh.",
                )
        is_counted = min(values["epoch"], values["step"], values["position"]) >= 0
        if not is_counted or self._is_epoch_done(values["position"]):
            raise ConfigError(
                f"sampler state {values} is out of range",
                "Load a state written by ElasticSampler.state_dict().",
            )
        if values["seed"] != self._seed:
            logger.info("Sampler seed %s replaced by the saved seed %s", self._seed, values["seed"])
        self._seed, self._epoch = values["seed"], values["epoch"]
        self._position, self._step = values["position"], values["step"]

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's local batches from the current position to the end of the epoch.

        Does not advance the sampler: the training loop calls :meth:`advance` after each
        committed step. The iterator freezes the position and world split it was made with,
        so after a world change (or a retried step) make a fresh one. Usable as a
        ``DataLoader`` ``batch_sampler``, also with worker processes (the batches are drawn
        in the main process).

        Note:
            A rank's share may be empty when ``dp_size`` exceeds a global batch; the default
            collate function fails on an empty list, so give the DataLoader a ``collate_fn``
            that accepts one if that can happen.
        """
        return self._local_batches(self._epoch, self._position, self._split())

    def iter_micro_batches(self) -> Iterator[list[int]]:
        """Every non-empty micro-batch this rank will train on, from the current position on.

        Unlike :meth:`__iter__` it runs on into the next epochs, so a ``DataLoader`` built on
        it (see ``elastic_rt.worker.batches``) can prefetch across an epoch's end. It freezes
        the position and world split it was made with: after a world change or a retried
        step make a fresh one. Empty shares yield nothing; the loop knows from
        :meth:`micro_batches` how many micro-batches each step takes.
        """
        epoch, position, size = self._epoch, self._position, self._micro_batch_size
        split = self._split()
        while True:
            for local in self._local_batches(epoch, position, split):
                chunk = size or max(len(local), 1)
                yield from (local[i : i + chunk] for i in range(0, len(local), chunk))
            epoch, position = epoch + 1, 0

    def __len__(self) -> int:
        """Local batches left in this epoch (one per remaining global batch)."""
        left = self._dataset_len - self._position
        if self._drop_last:
            return left // self._global_batch_size
        return -(-left // self._global_batch_size)

    def _split(self) -> tuple[int, int, tuple[int, ...] | None]:
        return self._dp_rank, self._dp_size, self._weights

    def _local_batches(
        self, epoch: int, position: int, split: tuple[int, int, tuple[int, ...] | None]
    ) -> Iterator[list[int]]:
        """This rank's shares from ``position`` on, with ``split`` (rank, size, weights)
        as it was when the iterator was made."""
        rank, size, weights = split
        while not self._is_epoch_done(position):
            batch = self._batch_at(epoch, position)
            start, end = share_bounds(len(batch), rank, size, weights)
            yield batch[start:end]
            position += len(batch)

    def _batch_at(self, epoch: int, position: int) -> list[int]:
        end = position + self._global_len(position)
        if not self._shuffle:
            return list(range(position, end))
        batch: list[int] = self._permutation(epoch)[position:end].tolist()
        return batch

    def _permutation(self, epoch: int) -> torch.Tensor:
        # Cached: a randperm of a large dataset costs far more than one batch.
        if self._order is None or self._order[:2] != (self._seed, epoch):
            generator = torch.Generator().manual_seed(epoch_seed(self._seed, epoch))
            order = torch.randperm(self._dataset_len, generator=generator)
            self._order = (self._seed, epoch, order)
        return self._order[2]

    def _global_len(self, position: int) -> int:
        return min(self._global_batch_size, self._dataset_len - position)

    def _is_epoch_done(self, position: int) -> bool:
        left = self._dataset_len - position
        return left <= 0 or (self._drop_last and left < self._global_batch_size)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"{name} must be an integer >= 1, got {value!r}", f"Set {name} to 1 or more."
        )
