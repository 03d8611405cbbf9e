"""Every thread's Python stack of a live process, taken from outside with gdb.

When a soak or a test finds training stalled, the workers' stacks say where they
wait; the runtime's own hang report (``worker/hang.py``) is off while a round
re-forms, which is where the soak's hangs were. gdb attaches, takes the GIL, and runs
:func:`faulthandler.dump_traceback` in the process (a thread blocked in C++ has
released the GIL). Without gdb, or without permission to attach, nothing is written.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_GDB_TIMEOUT_S = 60.0


def dump_python_stacks(pid: int, out: Path) -> bool:
    """Write ``pid``'s Python stacks (all threads) to ``out``; whether it worked."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return False
    dump = (f"import faulthandler; faulthandler.dump_traceback(open({str(out)!r}, 'w'), "
            "all_threads=True)")
    command = [gdb, "-p", str(pid), "-batch", "-nx",
               "-ex", "call (int)PyGILState_Ensure()",
               "-ex", f"call (int)PyRun_SimpleString({_c_string(dump)})",
               "-ex", "call (void)PyGILState_Release($1)"]
    try:
        subprocess.run(command, capture_output=True, timeout=_GDB_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.exists() and out.stat().st_size > 0


def _c_string(text: str) -> str:
    """``text`` as a C string literal for gdb's ``call``."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
