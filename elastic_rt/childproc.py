"""Child processes that die with their parent, started without ``preexec_fn``.

A process holding gRPC threads (every agent, every test) must not run Python
between fork and exec: gRPC's fork handlers abort the child (seen here as
workers dying with SIGABRT at start). So the parent-death signal is set by
``setpriv --pdeathsig KILL`` (util-linux, on every Debian-like system) in the
child, and the new session by ``start_new_session`` (done in C by subprocess).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

_SETPRIV = shutil.which("setpriv")


def dying_with_parent(command: list[str]) -> list[str]:
    """``command`` wrapped so the child gets SIGKILL when its parent dies.

    Without setpriv (not Linux) the command runs unwrapped: an orphan is then
    still stopped by process group, just not automatically.
    """
    if _SETPRIV is None:
        return list(command)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *command]


def owned_temp_dir(prefix: str) -> str:
    """A new temporary dir named ``<prefix><our pid>-…``, after removing dead owners' ones.

    A SIGKILLed owner cannot clean up after itself; the next owner of the same
    kind does, so such dirs never pile up.
    """
    root = Path(tempfile.gettempdir())
    for path in root.glob(f"{prefix}*"):
        try:
            owner = int(path.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if owner != os.getpid() and not _pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
