"""The run's fenced "latest committed checkpoint" pointer, as a Protocol.

A commit is judged against the round the saved state belongs to: the save carries
that round's :class:`Fence` to the commit, which may run in the background after the
loop has moved on (a save of round k committed while round k+1 forms is refused with
k's token, never accepted or refused by k+1's). The etcd implementation lives with the
rendezvous (``rendezvous/checkpoint_pointer.py``); the checkpoint code only reads the
name and asks for a commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Fence:
    """The round a save's state was taken in."""

    round: int
    """Its number: the save's events carry it."""
    token: int
    """Its fencing token: the commit is refused unless this round is still current."""


@runtime_checkable
class PointerStore(Protocol):
    """Where the name of the newest committed checkpoint of a run is kept."""

    def read(self) -> str | None:
        """The committed checkpoint's folder name (``step-00000120-ab12cd``) or None."""
        ...

    def commit(self, name: str, *, step: int, token: int | None) -> None:
        """Point at ``name``, the checkpoint of ``step``, if the round of ``token`` (the
        :attr:`Fence.token` of the save) is still the run's current round.

        Raises:
            FencedOutError: that round is stale (or no token came to check it by);
                the commit did not happen.
        """
        ...
