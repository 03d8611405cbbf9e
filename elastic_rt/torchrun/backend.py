"""torch's ``RendezvousBackend`` on etcd: the state is one key, fenced by its revision.

``set_state`` is one etcd transaction: write if the key's mod revision is still the
caller's token (absent for no token), else read what is there. The revision the write
created is the new token, so a stale writer can never overwrite a newer state.
"""

from __future__ import annotations

import base64
import binascii
from typing import Callable, TypeVar

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_rt.errors import ElasticError
from elastic_rt.rendezvous.kv import Get, KVStore, Put

T = TypeVar("T")

BACKEND_NAME = "etcd-v3"


class EtcdV3RendezvousBackend(RendezvousBackend):
    """The rendezvous state of one run generation, at ``<prefix>/state``.

    Args:
        kv: the etcd client (EtcdKV in production).
        prefix: the generation's key prefix (see :mod:`elastic_rt.torchrun.generation`).
    """

    def __init__(self, kv: KVStore, prefix: str) -> None:
        self._kv = kv
        self._key = f"{prefix}/state"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        current = _call(lambda: self._kv.get(self._key))
        if current is None:
            return None
        return _decode(current.value), current.mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            # Not a token of ours: it cannot match, so answer with what is there.
            current = self.get_state()
            return None if current is None else (*current, False)
        expect = {self._key: int(token) if token is not None else 0}
        encoded = base64.b64encode(state)
        result = _call(lambda: self._kv.txn(
            expect, [Put(self._key, encoded), Get(self._key)], [Get(self._key)]))
        found = result.reads[0] if result.reads else []
        if not found:
            return None  # deleted between the comparison and the read: none there
        kept = found[0]
        value = state if result.succeeded else _decode(kept.value)
        return value, kept.mod_revision, result.succeeded


def _decode(encoded: bytes) -> bytes:
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RendezvousStateError(
            "the etcd-v3 rendezvous state is corrupt (not base64); delete the run's keys "
            "under /elastic_rt/torchrun/<run_id>/ or use another --rdzv-id"
        ) from exc


def _call(call: Callable[[], T]) -> T:
    """Run an etcd call, reporting its failure as torch's connection error."""
    try:
        return call()
    except ElasticError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
