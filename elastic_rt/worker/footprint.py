"""What a long-lived worker holds, read at every re-form: threads, descriptors, memory, groups.

Why: a worker may go through hundreds of re-forms (a soak of random faults, a spot
fleet), and anything a round leaves behind (gloo's threads and sockets, a store client,
buffers) then grows with the number of failures until the process dies of it. The
figures ride on the ``groups.reformed`` event, so a soak reads the curve per worker
from the event log (``scripts/bench/soak.py``) without attaching to the process.

Read from ``/proc/self`` (Linux): native threads, not only Python's (gloo's loop and
worker threads are C++); every open descriptor (sockets included). Elsewhere a figure
is None.
"""

from __future__ import annotations

import os

from elastic_rt.process_groups import abandoned_group_count
from elastic_rt.worker.rss_peak import rss_bytes


def footprint() -> dict[str, int | None]:
    """This process's threads, open descriptors, resident bytes, and the process groups
    of abandoned rounds it still holds (``process_groups.release_abandoned``)."""
    return {
        "threads": _entries("/proc/self/task"),
        "open_fds": _entries("/proc/self/fd"),
        "rss_bytes": rss_bytes(),
        "abandoned_groups": abandoned_group_count(),
    }


def _entries(folder: str) -> int | None:
    try:
        return len(os.listdir(folder))
    except OSError:
        return None
