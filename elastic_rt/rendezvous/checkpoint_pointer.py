"""The run's "last committed checkpoint" pointer in etcd, committed fenced.

A checkpoint is committed by its manifest plus this pointer. The pointer is
written in a transaction that compares the round key's revision with the token of
the round the checkpoint's state was saved in (it comes with the commit), so
workers of an old round (a cut-off node that has not yet noticed) can never move it.
"""

from __future__ import annotations

import json

from elastic_rt.errors import FencedOutError
from elastic_rt.rendezvous.registry import RunRegistry

_KEY = "checkpoint"


class FencedPointer:
    """Implements the checkpoint package's ``PointerStore`` on the run's keys.

    Args:
        registry: the run's keys.
        url: the checkpoint URL, recorded for ``elastic-rt status``.
    """

    def __init__(self, registry: RunRegistry, url: str) -> None:
        self.registry = registry
        self.url = url

    def read(self) -> str | None:
        item = self.registry.kv.get(self.registry.key(_KEY))
        if item is None:
            return None
        return str(json.loads(item.value)["name"])

    def commit(self, name: str, *, step: int, token: int | None) -> None:
        """Raises FencedOutError when the round of ``token`` is no longer current (or no
        token came: nothing proves the state current)."""
        if token is None:
            raise FencedOutError(f"{name} carries no round token to check against the run's")
        value = json.dumps({"name": name, "step": step, "url": self.url}).encode()
        self.registry.commit_fenced(_KEY, value, token)
