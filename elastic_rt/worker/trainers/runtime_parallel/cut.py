"""Cut the blocks into pipeline stages, and place the stages on pipeline ranks. Pure.

Rule: ``stages = pp * stages_per_rank`` contiguous, non-empty runs of blocks whose largest
parameter count (the modules before the blocks count on the first stage, those after on
the last) is as small as it can be; among equal cuts, the one with the earliest stage
boundaries. Stage ``s`` runs on pipeline rank ``s % pp`` (torch's loop order for
interleaved schedules; one stage per rank is the plain case). Every rank of a round computes
the same cut from the same description, so nobody sends a cut to anybody.
"""

from __future__ import annotations

from elastic_rt.errors import ConfigError


def cut_stages(block_sizes: list[int], stages: int, *, first: int = 0,
               last: int = 0) -> list[range]:
    """The blocks of each of ``stages`` stages, balanced by parameter count.

    Args:
        block_sizes: parameters per block, in model order.
        stages: how many stages (``pp * stages_per_rank``).
        first: parameters before the blocks (on stage 0).
        last: parameters after the blocks (on the last stage).

    Raises:
        ConfigError: fewer blocks than stages.
    """
    n = len(block_sizes)
    if not 1 <= stages <= n:
        raise ConfigError(f"{stages} pipeline stages for a model of {n} blocks",
                          "Set ModelLimits(max_pp=...) and stages_per_rank so that "
                          "pp x stages_per_rank <= the number of blocks.")
    prefix = [0]
    for size in block_sizes:
        prefix.append(prefix[-1] + size)

    def weight(stage: int, start: int, stop: int) -> int:
        extra = (first if stage == 0 else 0) + (last if stage == stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    # best[k][i]: the smallest max weight of stages k.. over blocks i..n, and its first cut.
    best: list[list[tuple[int, int]]] = [[(0, 0)] * (n + 1) for _ in range(stages + 1)]
    for i in range(n + 1):
        best[stages][i] = (0 if i == n else -1, n)
    for k in range(stages - 1, -1, -1):
        for i in range(n + 1):
            choice = (-1, n)
            for stop in range(i + 1, n - (stages - k - 1) + 1):
                rest = best[k + 1][stop][0]
                if rest < 0:
                    continue
                value = max(weight(k, i, stop), rest)
                if choice[0] < 0 or value < choice[0]:
                    choice = (value, stop)
            best[k][i] = choice
    cuts, start = [], 0
    for k in range(stages):
        stop = best[k][start][1]
        cuts.append(range(start, stop))
        start = stop
    return cuts


def stages_of_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, in order (loop placement)."""
    return [pp_rank + v * pp for v in range(stages_per_rank)]
