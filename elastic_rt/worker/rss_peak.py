"""How far one phase pushed this process's resident memory above where the phase began.

Why: a restore may cost at most a fixed amount of memory beyond the state itself (256 MB
a rank, whatever the model), and what breaks that is a transient copy (a staging buffer,
a flat concatenation) that lives for milliseconds: no sampling of the RSS would see it.
The kernel keeps the peak (``VmHWM``) for us; writing ``5`` to ``/proc/self/clear_refs``
resets it to the current RSS (Linux 4.0+), so the peak read at the end covers the phase
alone. Other threads of the process (a loader's prefetch, peer copies) count too: it is
the process's memory.

Where the kernel does not offer this (not Linux, or no permission), the figure is None.
"""

from __future__ import annotations

import re

_STATUS = "/proc/self/status"


def _kib(field: str) -> int:
    with open(_STATUS) as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if found is None:
        raise OSError(f"no {field} in {_STATUS}")
    return int(found.group(1))


class RssPeak:
    """The peak resident memory since it was made, above the RSS at that moment."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            self._start_kib: int | None = _kib("VmRSS")
        except OSError:
            self._start_kib = None

    def growth_bytes(self) -> int | None:
        """Peak RSS since this was made minus the RSS then, in bytes; None if unknown."""
        if self._start_kib is None:
            return None
        try:
            return max(0, _kib("VmHWM") - self._start_kib) * 1024
        except OSError:
            return None


def rss_bytes() -> int | None:
    """This process's resident memory now, in bytes; None if unknown."""
    try:
        return _kib("VmRSS") * 1024
    except OSError:
        return None
