"""Who this worker is in the current round: rank, world, layout, process groups."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_rt.layout import Layout
from elastic_rt.process_groups import Groups


@dataclass(frozen=True)
class Context:
    """One worker's place in one round. Replaced, never mutated, at each re-form."""

    rank: int
    world_size: int
    local_rank: int
    node_id: str
    round: int
    token: int
    """The round's fencing token: commits carrying an older one are refused."""
    layout: Layout
    groups: Groups
    step: int = 0
    """The step being trained (counted from 1); after ``run`` returns, the last one."""

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank).dp

    @property
    def dp_size(self) -> int:
        return self.layout.dp


_current: Context | None = None


def context() -> Context:
    """The current round's context; after :func:`elastic_rt.run` returns, the last round's.

    Raises:
        RuntimeError: no elastic loop has run in this process.
    """
    if _current is None:
        raise RuntimeError(
            "elastic_rt.context() needs elastic_rt.run() to have started in this process"
        )
    return _current


def set_context(ctx: Context | None) -> None:
    global _current
    _current = ctx
