"""What a run leaves behind: keys and leases in etcd, entries in the temp dir.

etcd: every key under the run's prefix ``/elastic_rt/<run_id>/``, counted by shape
(``store/<k>`` for every round's ``store/0``, ``store/1``...), with those still on a
lease; and every lease the cluster still grants, listed by ``etcdctl`` where it sits
beside the etcd binary (the project's client, python3-etcd3, predates etcd's
LeaseLeases call). Temp dir: entries that appeared during the run and carry the PID
of a process the run started (``elastic-rt-agent-<pid>-...``,
``elastic_rt.childproc.owned_temp_dir``), with the files inside them; entries of
other processes (another run on the same machine) are not ours to count.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from elastic_rt.etcd_server import find_etcd_binary
from elastic_rt.rendezvous.etcd_kv import EtcdKV


@dataclass(frozen=True)
class EtcdLeft:
    keys: dict[str, int]
    """Keys under the run's prefix, by shape (digits replaced by ``<k>``)."""
    leased_keys: int
    leases: int | None
    """Leases the cluster still grants (None: no etcdctl to list them)."""

    @property
    def key_count(self) -> int:
        return sum(self.keys.values())


def etcd_left(endpoint: str, run_id: str) -> EtcdLeft:
    """What the run ``run_id`` left in the etcd at ``endpoint`` (one or more members)."""
    prefix = f"/elastic_rt/{run_id}/"
    kv = EtcdKV(endpoint)
    try:
        found = kv.get_prefix(prefix)
    finally:
        kv.close()
    shapes = Counter(re.sub(r"\d+", "<k>", item.key[len(prefix):]) for item in found)
    return EtcdLeft(dict(sorted(shapes.items())), sum(item.lease != 0 for item in found),
                    _lease_count(endpoint))


def _lease_count(endpoint: str) -> int | None:
    etcdctl = Path(find_etcd_binary()).with_name("etcdctl")
    if not etcdctl.exists():
        return None
    done = subprocess.run([str(etcdctl), f"--endpoints={endpoint}", "lease", "list", "-w", "json"],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return None
    return len(json.loads(done.stdout).get("leases") or [])


def temp_entries() -> set[str]:
    """The names in the temp dir now."""
    return set(os.listdir(tempfile.gettempdir()))


@dataclass(frozen=True)
class TempLeft:
    entries: tuple[str, ...]
    """New entries in the temp dir named with a PID of the run's processes."""
    files: int
    """Files inside them (acks, error files, logs...)."""


def temp_left(before: set[str], pids: set[int]) -> TempLeft:
    """What appeared in the temp dir since ``before`` and carries one of ``pids``."""
    root = Path(tempfile.gettempdir())
    ours = sorted(name for name in temp_entries() - before if _pid_in(name) & pids)
    files = sum(len(files) for name in ours for _, _, files in os.walk(root / name))
    return TempLeft(tuple(ours), files)


def _pid_in(name: str) -> set[int]:
    return {int(n) for n in re.findall(r"(?<![0-9a-z])\d{2,7}(?![0-9a-z])", name)}
