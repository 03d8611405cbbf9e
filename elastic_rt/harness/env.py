"""The interpreter and environment for children that must import this checkout.

Agents, workers and benchmarks' baselines run as separate interpreters; with the
checkout first on ``PYTHONPATH`` they import the code under test (and ``scripts.*``),
whatever is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (this package is used from a source checkout)."""
PYTHON = sys.executable


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment, the checkout first on ``PYTHONPATH``, INFO logs, ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("ELASTIC_RT_LOG_LEVEL", "INFO")
    env.update(extra)
    return env
