"""The run's fenced "latest committed checkpoint" pointer, as a Protocol.

The etcd implementation lives with the rendezvous (it needs the round's fencing
token); the checkpoint code only reads the name and asks for a commit.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PointerStore(Protocol):
    """Where the name of the newest committed checkpoint of a run is kept."""

    def read(self) -> str | None:
        """The committed checkpoint's folder name (``step-00000120-ab12cd``) or None."""
        ...

    def commit(self, name: str) -> None:
        """Point at ``name``.

        Raises:
            FencedOutError: our round is stale; the commit did not happen.
        """
        ...
