"""A package's names imported on first use (PEP 562's module ``__getattr__``).

The package ``elastic_rt`` must not load torch for the agent and the CLI, and
``elastic_rt.checkpoint`` must not load torch.distributed.checkpoint and DTensor for a worker
that writes no checkpoint: each maps its public names to the modules that define them and
resolves a name when it is first read.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping


def resolve(package: str, exports: Mapping[str, str], name: str) -> Any:
    """``name`` from the module ``exports`` maps it to, imported now.

    Raises:
        AttributeError: ``package`` exports no such name (as for any missing attribute).
    """
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
