"""What the repository's tests, benchmarks and chaos matrix share to drive real processes.

One copy of each piece they all need: a :class:`ProcessLedger` that starts process
trees in new sessions, remembers every descendant it sees and kills by process group
on close; :func:`wait_until`, a poll with a deadline; :func:`child_env`, the
environment a child needs to import this checkout; and (imported on its own, it needs
torch) ``parallel_models``, one small model trained alike under every layout, which the
examples run and the resharding tests check. It lives in the package, not under
``tests/`` or ``scripts/``, so all of them import it without path tricks.

Only tests, scripts and benchmarks import this package; the library's worker and
agent code never does (``tests/unit/test_harness.py`` checks that).
"""

from elastic_rt.harness.env import PYTHON, REPO, child_env
from elastic_rt.harness.ledger import ProcessLedger
from elastic_rt.harness.waits import WaitTimeout, wait_until

__all__ = ["PYTHON", "REPO", "ProcessLedger", "WaitTimeout", "child_env", "wait_until"]
