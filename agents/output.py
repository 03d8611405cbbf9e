"""Where each local worker's stdout and stderr go: torchrun's ``--log-dir``,
``-r/--redirects``, ``-t/--tee`` and ``--local-ranks-filter``, with its meaning.

Pure: :func:`parse_std` and :func:`parse_ranks` read the flags, :func:`plan_streams`
decides per local rank what goes to a file, what to the console and where
``@record``'s error file is. :mod:`agents.processes` opens the files and copies tee'd
lines. The layout on disk is torchrun's, one level up from the attempt:
``<log_dir>/<run_id>_<node>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log``
and ``error.json`` beside them.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass


class Std(enum.IntFlag):
    """Which standard streams a setting applies to (torchrun's ``Std`` values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def parse_std(text: str, flag: str) -> Std | dict[int, Std]:
    """``3`` (all local ranks) or ``0:1,1:2`` (per local rank), as torchrun reads it.

    Raises:
        ValueError: with a sentence naming ``flag`` and the value.
    """
    try:
        if ":" not in text:
            return Std(_std_value(text))
        pairs = (item.split(":") for item in text.split(","))
        return {int(rank): Std(_std_value(value)) for rank, value in pairs}
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a stream setting") from None


def _std_value(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 3:
        raise ValueError(text)
    return value


def parse_ranks(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter 0,2`` -> {0, 2}; empty means every rank is shown.

    Raises:
        ValueError: the text is not a comma-separated list of ranks.
    """
    if not text:
        return None
    try:
        ranks = frozenset(int(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"--local-ranks-filter {text!r} is not a list of local ranks") from None
    if min(ranks) < 0:
        raise ValueError(f"--local-ranks-filter {text!r} is not a list of local ranks")
    return ranks


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """The launch flags about worker output (the defaults print everything, like torchrun)."""

    log_dir: str | None = None
    """Base directory for log and error files; ``None``: the agent's temporary dir."""
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    ranks_filter: frozenset[int] | None = None
    """Local ranks whose output reaches the console; ``None``: all."""
    role: str = "default"
    """torchrun's ``--role``: ``ROLE_NAME`` and the tee prefix ``[<role><local_rank>]:``."""


@dataclass(frozen=True, slots=True)
class Streams:
    """One worker's output: files to write, and whether each stream reaches the console."""

    local_rank: int
    stdout_file: str | None
    stderr_file: str | None
    show_stdout: bool
    """When a file is set too, lines are copied to both (tee)."""
    show_stderr: bool
    error_file: str
    prefix: str


def plan_streams(spec: OutputSpec, nproc: int, attempt_dir: str) -> list[Streams]:
    """Decide, for each local rank, torchrun's destinations for its streams."""
    plans = []
    for rank in range(nproc):
        tee = _for_rank(spec.tee, rank)
        to_file = _for_rank(spec.redirects, rank) | tee
        shown = spec.ranks_filter is None or rank in spec.ranks_filter
        rank_dir = os.path.join(attempt_dir, str(rank))
        plans.append(
            Streams(
                local_rank=rank,
                stdout_file=os.path.join(rank_dir, "stdout.log") if to_file & Std.OUT else None,
                stderr_file=os.path.join(rank_dir, "stderr.log") if to_file & Std.ERR else None,
                show_stdout=shown and (not to_file & Std.OUT or bool(tee & Std.OUT)),
                show_stderr=shown and (not to_file & Std.ERR or bool(tee & Std.ERR)),
                error_file=os.path.join(rank_dir, "error.json"),
                prefix=f"[{spec.role}{rank}]:",
            )
        )
    return plans


def _for_rank(setting: Std | dict[int, Std], rank: int) -> Std:
    return setting.get(rank, Std.NONE) if isinstance(setting, dict) else setting
