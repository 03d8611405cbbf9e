"""Keep a long training process's heap near its working set, at no speed cost.

glibc adapts two thresholds as a program runs: after the first large block it frees, it
serves blocks of up to 32 MiB from the heap instead of ``mmap`` (fast: no page faults for
each new tensor), and it raises the trim threshold to twice that, so up to 64 MiB of free
memory at the top of each heap is kept rather than returned. With gradients, optimizer
temporaries and loader batches freed in a different order on several threads, that kept
memory piles up. Two measures, both glibc-only and both left to the user who tunes glibc
through its ``MALLOC_*`` variables or ``GLIBC_TUNABLES``:

- :func:`pin_heap` pins the mmap threshold at 32 MiB and the trim threshold at
  the 64 MiB glibc's adaptation would reach (256 MiB under FSDP, below): the fast heap
  path stays and the adaptation stops. Pinning the mmap threshold alone leaves the trim
  threshold at its 128 KiB default, and then every large block freed at the top of the
  heap goes back to the OS and is faulted in again by the next step. It also puts every
  thread on the main heap (one arena): gloo's threads allocate each collective's
  temporaries, and a thread's own arena grows by 64 MiB heaps that glibc maps for the
  block and unmaps as soon as it is free (strace of an FSDP worker: one heap mapped and
  unmapped per collective in a ``pt_gloo_runloop`` thread), so every step faulted those
  pages in again: 5,000-18,000 minor faults a step per worker, varying with which rank's
  thread got which arena. On the main heap the trim threshold keeps them: 500-1,200
  faults a step under FSDP (1,100-1,600 in the bench, against glibc's default 9,000-37,000).
  Replicated workers gain less: 2,800-4,300 against 5,200-7,300 in an A/B of 100 steps,
  3,700-8,700 in the bench (other sources remain there). The training
  thread and the collectives' threads rarely allocate at once, so sharing the one arena's
  lock costs nothing measurable.
- :class:`HeapTrimmer` returns the heap's free pages (``malloc_trim``) when the process
  has grown past the size it settled at by more than a margin. Free chunks *inside* the
  heap, below a live block, are never returned by glibc on its own; which chunks end up
  there depends on thread timing, so on a loaded machine a worker's RSS crept from 850 to
  1370 MiB over 100 steps while its live memory stayed the same.

Measured on the 16.8M-parameter MLP of ``scripts/bench/overhead.py`` (2 workers, 100
steps): glibc's default 1225-1555 MiB peak RSS per worker; mmap threshold pinned at 32 MiB
1012-1016 MiB quiet but up to 1336-1431 MiB at load average 6-14; pinned plus the trimmer
(64 MiB margin) 888 MiB at load 19 with one to five trims in 100 steps. Once backward
handed fresh gradients to the buckets (``grad_sync``), that margin trimmed 18-25 times in
150 steps (the heap swings by more within a step), each trim faulting the next step's
temporaries back in; with the 64 MiB trim threshold and a margin of max(128 MiB, 1/8):
5 trims in 150 steps, peak RSS 0.87-0.89x torchrun + DDP's, step time 1.01x. Trimming after
every step instead costs 55 ms a step (every page of the step's temporaries is faulted
back in), as does an mmap threshold of 1 MiB (50-70 ms); torch's own advice for the
symptom is another allocator (jemalloc, tcmalloc), which needs an extra library.

Under FSDP (``run(limits=ModelLimits(max_shard > 1))``, chosen in ``loop.run``) the
trimmer is off and the trim threshold is pinned higher, at 256 MiB: there every unit's
all-gathered parameters and unsharded gradients (16 MiB apiece on that MLP) are allocated
and freed again within each step, so the free top of the heap is what the next step needs.
With the 128 KiB trim threshold those pages went back to the OS at every free, and the
trimmer fired every two or three steps (the heap swings by more than its margin within a
step): about 70,000 minor page faults a step per worker, and 1.3-1.7x the step time of
torchrun + ``fully_shard``. glibc's own adaptation (the twin's) stops at a 64 MiB trim
threshold and still faults 10,000-45,000 pages a step, varying from run to run with the
order of frees (1.14x, median of 8 runs); pinned at 32 MiB and 256 MiB, 1.05x (median of
11 runs) at 0.96x the twin's peak RSS (``scripts/bench/overhead.py --fsdp`` prints both
figures; the rest of the gap is not the heap, see ``docs/sharding.md``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from typing import Any

import psutil

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest value glibc's own adaptation reaches (64-bit)
REPLICATED_TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
"""Replicated: where glibc's own adaptation would put it (see the module's docstring)."""
SHARDED_TRIM_THRESHOLD_BYTES = 256 << 20
"""Under FSDP: the free top of a heap kept for the next step (see the module's docstring)."""
_USER_SETTINGS_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                      "GLIBC_TUNABLES")


def _glibc() -> Any | None:
    """The C library, when it is glibc and the user left its tuning to us."""
    if any(name in os.environ for name in _USER_SETTINGS_ENV):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None  # not glibc (musl, macOS): nothing to tune
    return libc


def pin_heap(*, trim_threshold_bytes: int | None = None) -> bool:
    """Stop glibc from adapting its mmap and trim thresholds for the rest of this process,
    and serve threads started from now on from the main heap.

    Call it before the process groups exist: a thread keeps the arena it first allocated
    from.

    Args:
        trim_threshold_bytes: also fix the trim threshold (the free memory kept at the top
            of a heap) at this, instead of leaving it at glibc's 128 KiB default.

    Returns whether the settings were made (not on other C libraries, nor when the user
    tunes glibc through ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES``).
    """
    libc = _glibc()
    if libc is None:
        return False
    is_set = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    is_set = bool(libc.mallopt(_M_ARENA_MAX, 1)) and is_set
    if trim_threshold_bytes is not None:
        is_set = bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)) and is_set
    logger.debug("heap pinned (mmap threshold %d bytes, one arena): %s", MMAP_THRESHOLD_BYTES,
                 is_set)
    return is_set


def _resident_bytes(process: psutil.Process) -> Callable[[], int]:
    return lambda: int(process.memory_info().rss)


class HeapTrimmer:
    """Called after every step; trims the heap when RSS outgrows the settled size.

    The settled size is the RSS after the first step, and again one step after each trim
    (the step's temporaries faulted back in), so a working set that truly grows costs one
    trim per ``margin`` of growth, not one per step.

    Args:
        min_margin_bytes: growth tolerated before a trim, at least...
        margin_fraction: ...or this fraction of the settled size, whichever is larger.
        rss: reads the resident set size (bytes); ``trim`` returns free heap pages. Both
            default to the real ones; a trimmer on a C library other than glibc does nothing.
    """

    def __init__(self, *, min_margin_bytes: int = 128 << 20, margin_fraction: float = 1 / 8,
                 rss: Callable[[], int] | None = None,
                 trim: Callable[[], object] | None = None) -> None:
        libc = _glibc() if trim is None else None
        self._trim = trim if trim is not None else (lambda: libc.malloc_trim(0)) if libc else None
        self._rss = rss or _resident_bytes(psutil.Process())
        self.min_margin, self.margin_fraction = min_margin_bytes, margin_fraction
        self.settled: int | None = None
        self.trims = 0

    def after_step(self) -> bool:
        """Trim if the process grew past its settled size by the margin; return whether."""
        if self._trim is None:
            return False
        rss = self._rss()
        if self.settled is None:
            self.settled = rss
            return False
        if rss <= self.settled + max(self.min_margin, int(self.settled * self.margin_fraction)):
            return False
        self._trim()
        self.trims += 1
        self.settled = None  # re-measured after the next step
        logger.debug("heap trimmed (%d so far): RSS was %d MiB", self.trims, rss >> 20)
        return True
