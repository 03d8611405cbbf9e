"""A ``torch.distributed.Store`` on etcd, for the agents of one run generation.

torch's dynamic rendezvous hands the agents a Store: rank 0 publishes the workers'
``MASTER_ADDR``/``MASTER_PORT`` there, the agents assign worker ranks and meet at the
exit barrier through it. Keeping it in etcd (not a TCPStore on one agent) means no
agent is special: any of them may die and the survivors still rendezvous. The workers'
own store is torch's TCPStore on the rank-0 agent, which torch creates per round.

Blocking reads poll etcd with a short back-off; the agents read a few keys per round.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist

from elastic_rt.errors import ElasticError
from elastic_rt.rendezvous.kv import KVStore

T = TypeVar("T")

_POLL_FIRST_S = 0.01
_POLL_MAX_S = 0.2


class EtcdStore(dist.Store):
    """Keys under ``<prefix>/store/`` in etcd.

    Args:
        kv: the etcd client.
        prefix: the generation's key prefix.
        timeout: how long ``get`` and ``wait`` block for a missing key.
    """

    def __init__(self, kv: KVStore, prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self._kv = kv
        self._prefix = f"{prefix}/store/"
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        _call(lambda: self._kv.put(self._key(key), _bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None)[0]

    def add(self, key: str, num: int) -> int:
        while True:
            current = _call(lambda: self._kv.get(self._key(key)))
            value = (int(current.value) if current is not None else 0) + int(num)
            revision = current.mod_revision if current is not None else 0
            written = _call(lambda: self._kv.put_if(
                self._key(key), str(value).encode(), expect={self._key(key): revision}))
            if written is not None:
                return value

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        while True:
            current = _call(lambda: self._kv.get(self._key(key)))
            if current is None and expected:
                return expected  # what c10d's stores answer for a missing key
            if current is not None and current.value != expected:
                return current.value
            revision = current.mod_revision if current is not None else 0
            written = _call(lambda: self._kv.put_if(
                self._key(key), desired, expect={self._key(key): revision}))
            if written is not None:
                return desired

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait_for(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return all(_call(lambda: self._kv.get(self._key(k))) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        return _call(lambda: self._kv.delete(self._key(key)))

    def num_keys(self) -> int:
        return len(_call(lambda: self._kv.get_prefix(self._prefix)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait_for(list(keys), None)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def _wait_for(self, keys: list[str], timeout: timedelta | None) -> list[bytes]:
        # c10d's base keeps the timeout (set_timeout); its stub does not declare it.
        default: timedelta = getattr(self, "timeout")
        limit = (timeout if timeout is not None else default).total_seconds()
        deadline = time.monotonic() + limit
        found: dict[str, bytes] = {}
        pause = _POLL_FIRST_S
        while True:
            for key in keys:
                if key not in found:
                    current = _call(lambda: self._kv.get(self._key(key)))
                    if current is not None:
                        found[key] = current.value
            if len(found) == len(keys):
                return [found[key] for key in keys]
            if time.monotonic() >= deadline:
                missing = [key for key in keys if key not in found]
                raise dist.DistStoreError(
                    f"etcd-v3 store: keys {missing} not set within {limit:.0f} s")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _POLL_MAX_S)


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # a list of ints, as pybind hands std::vector<uint8_t>


def _call(call: Callable[[], T]) -> T:
    """Run an etcd call; its failure becomes the RuntimeError c10d's callers expect."""
    try:
        return call()
    except ElasticError as exc:
        raise dist.DistNetworkError(str(exc)) from exc
