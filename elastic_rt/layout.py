"""Parallel layout: how a world of ranks splits into data, pipeline and tensor parallelism.

A :class:`Layout` is a value (``dp x pp x tp``) that maps every rank to mesh coordinates and
back. Its ``shard`` degree says how the ``dp`` ranks hold the model's state: 1 keeps a whole
replica on each (DDP); ``shard == dp`` shards parameters, gradients and optimizer state over
all of them (FSDP, ``fsdp4``); in between, consecutive groups of ``shard`` data-parallel ranks
each hold one sharded copy, replicated across the groups (HSDP, ``hsdp2x2``: 2 replicas of 2
shards). With ``pp`` or ``tp`` the same holds per ``(pp, tp)`` part: the ``dp`` ranks of one
part shard it (``pp2xfsdp2``, ``fsdp2xtp2``, ``pp2xhsdp2x2xtp2``), torchtitan's 3-D layout.

Axis order is ``("pp", "dp", "tp")`` with ``tp`` innermost, so the ranks of one tensor
group are neighbours (usually on one node, where the fastest links are) and the ranks of one
data-parallel group hold replicas of the same shard::

    rank = (pp_i * dp + dp_i) * tp + tp_i

:func:`plan_layout` picks a layout for a world size from the model's limits; it is pure and
deterministic, so every rank of a round computes the same plan without talking to the others.
This module only does arithmetic: building process groups from the rank lists is
``process_groups.py``'s job, which is why it must not import ``torch.distributed``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from elastic_rt.errors import ConfigError

logger = logging.getLogger(__name__)

AXES = ("pp", "dp", "tp")
_KEYS = (*AXES, "shard")


class Coords(NamedTuple):
    """A rank's position on the mesh."""

    pp: int
    dp: int
    tp: int


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"{name} must be an integer >= 1, got {value!r}", f"Set {name} to 1 or more."
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """``dp`` data-parallel replicas of a model cut into ``pp`` stages of ``tp`` shards each.

    Invariant: every degree is >= 1; ``world_size == dp * pp * tp``; ``shard`` divides ``dp``.

    Raises:
        ConfigError: a degree is not a positive integer, or ``shard`` does not fit.
    """

    dp: int
    pp: int = 1
    tp: int = 1
    shard: int = 1
    """How many data-parallel ranks one copy of the state is sharded over (1: replicated)."""

    def __post_init__(self) -> None:
        for axis in _KEYS:
            _check_positive(f"layout {axis}", getattr(self, axis))
        if self.dp % self.shard:
            raise ConfigError(f"layout shard={self.shard} does not divide dp={self.dp}",
                              "Pick a shard degree that divides the data-parallel degree.")

    @property
    def replicas(self) -> int:
        """How many whole copies of the state the data-parallel ranks hold."""
        return self.dp // self.shard

    def shard_index(self, rank: int) -> int:
        """Which of the ``shard`` pieces of the state ``rank`` holds (0 when replicated)."""
        return self.coords(rank).dp % self.shard

    def copies(self, pp: int = 0, tp: int = 0) -> list[list[int]]:
        """The ``replicas x shard`` grid of the ranks holding the ``(pp, tp)`` part: a row per
        sharded copy, its ranks in shard order (HSDP's ``("replicate", "shard")`` mesh)."""
        return [[self.rank_of(pp, r * self.shard + i, tp) for i in range(self.shard)]
                for r in range(self.replicas)]

    def shard_groups(self) -> list[list[int]]:
        """The ranks of each copy of the state (one sharded replica), in shard order, for
        every ``(pp, tp)`` part in turn (pp outer); empty when not sharded."""
        if self.shard == 1:
            return []
        return [row for pp in range(self.pp) for tp in range(self.tp)
                for row in self.copies(pp, tp)]

    def replicate_groups(self) -> list[list[int]]:
        """The ranks holding the same piece of the state, one per replica, per piece (of
        every ``(pp, tp)`` part in turn); empty when not sharded."""
        if self.shard == 1:
            return []
        return [[row[i] for row in self.copies(pp, tp)]
                for pp in range(self.pp) for tp in range(self.tp) for i in range(self.shard)]

    @property
    def world_size(self) -> int:
        """How many ranks the layout fills."""
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> Coords:
        """The mesh coordinates of ``rank``.

        Raises:
            ValueError: ``rank`` is outside ``[0, world_size)``.
        """
        self._check_rank(rank)
        return Coords(
            pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp
        )

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The rank at mesh coordinates ``(pp, dp, tp)``.

        Raises:
            ValueError: a coordinate is outside its axis.
        """
        for axis, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            size = getattr(self, axis)
            if not 0 <= value < size:
                raise ValueError(f"{axis} coordinate {value} is outside [0, {size}) of {self}")
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except ``axis``, in axis order.

        Raises:
            ValueError: unknown axis, or ``rank`` out of range.
        """
        self._check_axis(axis)
        here = self.coords(rank)._asdict()
        ranks = []
        for i in range(getattr(self, axis)):
            here[axis] = i
            ranks.append(self.rank_of(**here))
        return ranks

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, ordered by their lowest rank; together they cover the world.

        Raises:
            ValueError: unknown axis.
        """
        self._check_axis(axis)
        groups = {tuple(self.group_ranks(axis, rank)) for rank in range(self.world_size)}
        return [list(group) for group in sorted(groups)]

    def to_dict(self) -> dict[str, int]:
        """A JSON-able form, read back by :meth:`from_dict` (``shard`` only when sharded)."""
        data = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        return {**data, "shard": self.shard} if self.shard > 1 else data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """The layout :meth:`to_dict` wrote (``pp``, ``tp`` and ``shard`` default to 1).

        Raises:
            ValueError: unknown keys or a missing ``dp``.
            ConfigError: a degree is not a positive integer.
        """
        unknown = set(data) - set(_KEYS)
        if unknown or "dp" not in data:
            raise ValueError(f"not a layout: {dict(data)!r} (expected keys dp, pp, tp, shard)")
        return cls(dp=data["dp"], pp=data.get("pp", 1), tp=data.get("tp", 1),
                   shard=data.get("shard", 1))

    def __str__(self) -> str:
        if self.shard == 1:
            return f"dp{self.dp}xpp{self.pp}xtp{self.tp}"
        data = f"fsdp{self.shard}" if self.replicas == 1 else f"hsdp{self.replicas}x{self.shard}"
        # torchtitan's reading order: pipeline outermost, then data, then tensor
        return "x".join(([f"pp{self.pp}"] if self.pp > 1 else []) + [data]
                        + ([f"tp{self.tp}"] if self.tp > 1 else []))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) of layout {self}")

    @staticmethod
    def _check_axis(axis: str) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; the axes are {AXES}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelLimits:
    """What the model allows: how many stages it can be split into, and memory per rank.

    Attributes:
        max_pp: the most pipeline stages the model can be cut into.
        tp_options: the tensor-parallel degrees the model supports.
        min_dp: the fewest data-parallel replicas wanted (e.g. so a lost node leaves a replica).
        max_params_per_rank: the most parameters one rank can hold; needs ``n_params``.
        n_params: the model's parameter count, split evenly over ``pp * tp * shard`` shards.
        max_shard: the most data-parallel ranks one copy of the state may be sharded over
            (FSDP2 ``fully_shard``): 1 replicates it (the default); the ranks per node gives
            HSDP (shard within a node, replicate across nodes); at least the largest world,
            FSDP over every rank. With pipeline or tensor parallelism it shards each
            ``(pp, tp)`` part over its data-parallel ranks (the runtime-parallel family).

    Raises:
        ConfigError: a limit is not a positive integer, or only one of the memory limits is set.
    """

    max_pp: int = 1
    tp_options: tuple[int, ...] = (1,)
    min_dp: int = 1
    max_params_per_rank: int | None = None
    n_params: int | None = None
    max_shard: int = 1

    def __post_init__(self) -> None:
        _check_positive("max_pp", self.max_pp)
        _check_positive("max_shard", self.max_shard)
        _check_positive("min_dp", self.min_dp)
        if not self.tp_options:
            raise ConfigError(
                "tp_options is empty", "List at least one tensor-parallel degree, e.g. (1,)."
            )
        for tp in self.tp_options:
            _check_positive("each of tp_options", tp)
        if (self.max_params_per_rank is None) != (self.n_params is None):
            # One without the other cannot be checked, and silently ignoring it would
            # plan layouts that run out of memory.
            raise ConfigError(
                "max_params_per_rank and n_params must be given together",
                "Set both to plan by memory, or neither.",
            )
        if self.max_params_per_rank is not None and self.n_params is not None:
            _check_positive("max_params_per_rank", self.max_params_per_rank)
            _check_positive("n_params", self.n_params)

    def fits_memory(self, pp: int, tp: int, shard: int = 1) -> bool:
        """Whether one shard of a ``pp x tp`` split, sharded ``shard`` ways, fits on a rank."""
        if self.max_params_per_rank is None or self.n_params is None:
            return True
        return -(-self.n_params // (pp * tp * shard)) <= self.max_params_per_rank


def plan_layout(world_size: int, limits: ModelLimits = ModelLimits()) -> Layout:
    """The layout that fills ``world_size`` exactly with the most data parallelism that fits.

    Candidates are every ``pp <= max_pp`` and ``tp in tp_options`` whose product divides the
    world, with ``dp >= min_dp``, each with every ``shard <= max_shard`` dividing ``dp``
    (whatever ``pp`` and ``tp``), that fits memory. Among them the largest ``dp`` wins (fastest
    steps), then the smallest ``pp`` (fewer pipeline bubbles), then the smallest ``tp``, then
    the largest ``shard`` (least memory per rank). Deterministic, so all ranks agree.

    Raises:
        ConfigError: ``world_size`` is not positive, or no layout fits it.
    """
    _check_positive("world_size", world_size)
    candidates = [
        Layout(dp=world_size // (pp * tp), pp=pp, tp=tp, shard=shard)
        for pp in range(1, limits.max_pp + 1)
        for tp in sorted(set(limits.tp_options))
        if world_size % (pp * tp) == 0
        and world_size // (pp * tp) >= limits.min_dp
        for shard in _shard_options(world_size // (pp * tp), limits.max_shard)
        if limits.fits_memory(pp, tp, shard)
    ]
    if not candidates:
        raise ConfigError(
            f"no layout fills a world of {world_size} ranks with {limits}",
            "Change the node count so that dp x pp x tp can fill it, or relax the model limits "
            "(max_pp, tp_options, min_dp, max_params_per_rank, max_shard).",
        )
    layout = min(candidates, key=lambda c: (-c.dp, c.pp, c.tp, -c.shard))
    logger.debug("Planned layout %s for world size %s", layout, world_size)
    return layout


def _shard_options(dp: int, max_shard: int) -> list[int]:
    """The shard degrees a ``dp``-wide data-parallel axis can take: divisors up to ``max_shard``."""
    return [shard for shard in range(1, min(dp, max_shard) + 1) if dp % shard == 0]


def has_replica_for_every_shard(layout: Layout, lost_ranks: set[int]) -> bool:
    """Whether every ``(pp, tp)`` shard, and every piece of a sharded state, still has a
    data-parallel replica outside ``lost_ranks``.

    When it does, the survivors can restore lost state by broadcast from a replica instead of
    reading the last checkpoint (and lose no steps). Ranks outside the layout are ignored.
    """
    if layout.shard > 1:
        return all(any(rank not in lost_ranks for rank in group)
                   for group in layout.replicate_groups())
    return all(
        any(layout.rank_of(pp, dp, tp) not in lost_ranks for dp in range(layout.dp))
        for pp in range(layout.pp)
        for tp in range(layout.tp)
    )
