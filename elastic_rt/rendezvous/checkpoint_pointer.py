"""The run's "last committed checkpoint" pointer in etcd, committed fenced.

A checkpoint is committed by its manifest plus this pointer. The pointer is
written in a transaction that compares the round key's revision with the
writer's token, so workers of an old round (a cut-off node that has not yet
noticed) can never move it.
"""

from __future__ import annotations

import json
from typing import Callable

from elastic_rt.rendezvous.registry import RunRegistry

_KEY = "checkpoint"


class FencedPointer:
    """Implements the checkpoint package's ``PointerStore`` on the run's keys.

    Args:
        registry: the run's keys.
        url: the checkpoint URL, recorded for ``elastic-rt status``.
        token: returns the writer's current round token at commit time.
    """

    def __init__(self, registry: RunRegistry, url: str, token: Callable[[], int]) -> None:
        self.registry = registry
        self.url = url
        self.token = token

    def read(self) -> str | None:
        item = self.registry.kv.get(self.registry.key(_KEY))
        if item is None:
            return None
        return str(json.loads(item.value)["name"])

    def commit(self, name: str) -> None:
        """Raises FencedOutError when our round is no longer current."""
        step = int(name.split("-")[1]) if name.startswith("step-") else None
        value = json.dumps({"name": name, "step": step, "url": self.url}).encode()
        self.registry.commit_fenced(_KEY, value, self.token())
