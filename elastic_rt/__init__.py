"""elastic-rt: elastic, fault-tolerant training for PyTorch on an etcd rendezvous."""

from __future__ import annotations

__all__: list[str] = []
